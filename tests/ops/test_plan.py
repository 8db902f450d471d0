"""The planner and compose.yaml, with a simulated device (the probe's file seam) where a GPU is needed."""

import json
import shutil
import subprocess

import pytest

from common.gpu import Device, GPUProcess
from ops.interpolation import interpolate
from ops.plan import make_plan, order
from ops.stack import StackError, load, parse_size
from tests.backend.server_process import ROOT
from tests.ops.conftest import run_ops

GIB = 2**30


def test_the_stack_order_and_budgets_fit_a_4090(tmp_path, gpu_file):
    result = run_ops(tmp_path, "plan", "--profile", "image", "--json", env=gpu_file(24, 23.5))
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert [s["service"] for s in plan["steps"]] == ["backend", "mcp", "comfyui"]  # fixed first, elastic last
    backend, mcp, comfy = plan["steps"]
    assert backend["budget"] == int(0.45 * 24 * GIB) and mcp["budget"] == 0 and comfy["budget"] == 8 * GIB
    assert comfy["free_before"] == int(23.5 * GIB) - backend["budget"]
    assert plan["fits"] and plan["probe"] == "file"


def test_a_budget_that_does_not_fit_names_the_foreign_process_and_the_fix(tmp_path, gpu_file):
    env = {**gpu_file(24, 9, processes=[(4242, "blender", 14.5)]), "SCRIPTORIUM_LEASES": "0"}
    result = run_ops(tmp_path, "plan", "--profile", "image", env=env)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 2  # backend does not fit, and then (no leases) neither does comfyui
    assert "backend needs 10.8 GiB" in lines[0] and "only 9.0 GiB will be free" in lines[0]
    assert "blender (pid 4242) 14.5 GiB" in lines[0] and "lower x-ops.gpu_memory for backend" in lines[0]
    assert "comfyui" in lines[1] and "--lowvram" in lines[1]
    up = run_ops(tmp_path, "up", "--profile", "image", env=env)
    assert up.returncode == 2 and "blender" in up.stderr and not (tmp_path / "state").exists()  # nothing started


def test_an_elastic_budget_may_exceed_what_is_free_when_the_llm_can_sleep(tmp_path, gpu_file):
    env = {**gpu_file(24, 23), "SCRIPTORIUM_COMFYUI_GPU_MEMORY": "16GiB"}  # backend 10.8 GiB leaves 12.2 GiB
    with_leases = run_ops(tmp_path, "plan", "--profile", "image", "--json", env=env)
    assert with_leases.returncode == 0, with_leases.stderr
    comfy = json.loads(with_leases.stdout)["steps"][-1]
    assert comfy["service"] == "comfyui" and "lease" in comfy["note"]
    without = run_ops(tmp_path, "plan", "--profile", "image", env={**env, "SCRIPTORIUM_LEASES": "0"})
    assert without.returncode == 2 and "comfyui needs 16.0 GiB" in without.stderr
    too_big = run_ops(tmp_path, "plan", "--profile", "image", env={**env, "SCRIPTORIUM_COMFYUI_GPU_MEMORY": "30GiB"})
    assert too_big.returncode == 2  # more than the card has even with the LLM asleep


def test_byte_and_fraction_budgets(tmp_path, gpu_file):
    env = {**gpu_file(48, 47), "SCRIPTORIUM_BACKEND_GPU_MEMORY": "18GiB", "SCRIPTORIUM_COMFYUI_GPU_MEMORY": "0.25"}
    plan = json.loads(run_ops(tmp_path, "plan", "--profile", "image", "--json", env=env).stdout)
    budgets = {s["service"]: s["budget"] for s in plan["steps"]}
    assert budgets == {"backend": 18 * GIB, "mcp": 0, "comfyui": 12 * GIB}


def test_without_a_gpu_everything_runs_on_the_cpu(tmp_path):
    plan = make_plan(list(load(ROOT / "compose.yaml").services.values()), [])
    assert plan.device is None and not plan.problems and all(s.budget == 0 for s in plan.steps)


def write_compose(tmp_path, body: str):
    path = tmp_path / "compose.yaml"
    path.write_text(body)
    return path


def test_dependencies_first_then_fixed_before_elastic(tmp_path):
    stack = load(write_compose(tmp_path, """
services:
  painter: {image: x, x-ops: {memory: elastic, gpu_memory: 4GiB}}
  ui: {image: x, depends_on: [painter], x-ops: {memory: fixed}}
  llm: {image: x, x-ops: {memory: fixed, gpu_memory: 0.5}}
"""))
    assert [s.name for s in order(list(stack.services.values()))] == ["llm", "painter", "ui"]
    device = Device(0, "gpu", 16 * GIB, 16 * GIB, [GPUProcess(1, "x", 0)])
    plan = make_plan(list(stack.services.values()), [device], running={"llm"})
    assert [(s.service, s.running) for s in plan.steps] == [("llm", True), ("painter", False), ("ui", False)]


@pytest.mark.parametrize("body,message", [
    ("services:\n  a: {image: x, x-ops: {gpu_memory: lots}}\n", "not a size"),
    ("services:\n  a: {image: x, x-ops: {gpu_memory: 3GiBs}}\n", "unknown unit"),
    ("services:\n  a: {image: x, x-ops: {memory: greedy}}\n", "memory must be fixed or elastic"),
    ("services:\n  a: {image: x, depends_on: [ghost]}\n", "depends on unknown service"),
    ("services:\n  a: {image: '${NEEDED:?set NEEDED to the image}'}\n", "set NEEDED to the image"),
    ("services: [nope\n", "not valid YAML"),
])
def test_bad_compose_files_say_what_to_change(tmp_path, body, message):
    with pytest.raises(StackError, match=message):
        load(write_compose(tmp_path, body), env={})


def test_interpolation_and_sizes_follow_compose():
    env = {"A": "1", "EMPTY": ""}
    assert interpolate("${A} ${B:-two} ${EMPTY:-three} ${EMPTY-four} $$A ${B-${A}}", env) == "1 two three  $A 1"
    assert parse_size("18GiB", "x") == 18 * GIB and parse_size(0.4, "x") == 0.4 and parse_size("512MB", "x") == 512e6


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="Debian's docker-compose is not installed")
def test_compose_yaml_passes_docker_compose_config():
    for args in ([], ["--profile", "image"]):
        result = subprocess.run(["docker-compose", "-f", str(ROOT / "compose.yaml"), *args, "config", "-q"],
                                capture_output=True, text=True, cwd=ROOT)
        assert result.returncode == 0, result.stderr


def test_auto_budgets_the_backend_with_what_its_largest_model_needs(tmp_path, gpu_file, capsys, smollm2_path):
    """x-ops.gpu_memory auto: ops asks the backend's own command (--print-memory-need) and budgets that."""
    from backend.__main__ import main

    env = {**gpu_file(24, 23.5), "SCRIPTORIUM_BACKEND_GPU_MEMORY": "auto"}
    unfetched = run_ops(tmp_path, "plan", env=env)  # a fresh home has not pulled the model yet
    assert unfetched.returncode == 2
    assert "gpu_memory is auto" in unfetched.stderr and "models pull smollm2" in unfetched.stderr

    assert main(["serve", "--model", str(smollm2_path), "--print-memory-need"]) == 0
    need = json.loads(capsys.readouterr().out)["need_bytes"]
    env["SCRIPTORIUM_MODEL"] = str(smollm2_path)
    result = run_ops(tmp_path, "plan", "--profile", "image", "--json", env=env)
    assert result.returncode == 0, result.stderr
    backend, mcp, comfy = json.loads(result.stdout)["steps"]
    assert backend["budget"] == backend["need"] == need and 0 < need < 2**30
    flag = backend["command"].index("--gpu-memory-utilization")
    assert backend["command"][flag + 1] == str(need)  # the engine is started with exactly that budget
    assert comfy["free_before"] == int(23.5 * GIB) - need

    vllm = run_ops(tmp_path, "plan", env={**env, "SCRIPTORIUM_ENGINE": "vllm"})
    assert vllm.returncode == 2
    assert "gpu_memory is auto" in vllm.stderr and "only Scriptorium's engine" in vllm.stderr

    # ops up fetches the models before it measures them; a model it cannot fetch stops it before anything starts
    up = run_ops(tmp_path, "up", env={**env, "SCRIPTORIUM_MODEL": str(tmp_path / "missing.gguf")})
    assert up.returncode != 0 and "preparing" in up.stderr and "missing.gguf" in up.stderr
    assert not (tmp_path / "state").exists()
