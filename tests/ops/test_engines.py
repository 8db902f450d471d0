"""The backend's engine (SCRIPTORIUM_ENGINE): compose.yaml for each, the plan's budgets and exact commands, and the
process runner starting vLLM's and SGLang's native commands (their stand-ins here)."""

import json
import shutil
import subprocess

import httpx
import pytest
from ruamel.yaml import YAML

from tests.backend.server_process import ROOT, free_port
from tests.ops.conftest import run_ops
from tests.ops.standin_env import standin_env

GIB = 2**30
ENGINES = {  # engine: (its memory flag, its image, the program the process runner starts)
    "scriptorium": ("--gpu-memory-utilization", "scriptorium:latest", None),
    "vllm": ("--gpu-memory-utilization", "vllm/vllm-openai:latest", "vllm"),
    "sglang": ("--mem-fraction-static", "lmsysorg/sglang:latest", "sglang.launch_server"),
}


def after(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="Debian's docker-compose is not installed")
@pytest.mark.parametrize("engine", ENGINES)
def test_docker_compose_config_passes_for_each_engine(engine):
    flag, image, _ = ENGINES[engine]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "SCRIPTORIUM_ENGINE": engine}
    for args in ([], ["--profile", "image"]):
        result = subprocess.run(["docker-compose", "-f", str(ROOT / "compose.yaml"), *args, "config"],
                                capture_output=True, text=True, cwd=ROOT, env=env)
        assert result.returncode == 0, result.stderr
        backend = YAML(typ="safe").load(result.stdout)["services"]["backend"]
        assert backend["image"] == image and after(backend["command"], flag) == "0.45"
        assert backend["ports"] and backend["deploy"]["resources"]["reservations"]["devices"]
    if engine == "vllm":
        assert backend["entrypoint"] == ["vllm", "serve"] and "--enable-sleep-mode" in backend["command"]
        assert backend["environment"]["VLLM_SERVER_DEV_MODE"] == "1"
    if engine == "sglang":
        assert backend["command"][:3] == ["python3", "-m", "sglang.launch_server"]
        assert "--enable-memory-saver" in backend["command"]


@pytest.mark.parametrize("engine", ENGINES)
def test_plan_shows_each_engine_its_budget_and_exact_command(tmp_path, gpu_file, engine):
    flag, image, program = ENGINES[engine]
    env = {**gpu_file(24, 23.5), "SCRIPTORIUM_ENGINE": engine, "SCRIPTORIUM_BACKEND_GPU_MEMORY": "18GiB"}
    result = run_ops(tmp_path, "plan", "--profile", "image", "--json", env=env)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert [s["service"] for s in plan["steps"]] == ["backend", "mcp", "comfyui"]
    backend, mcp, comfy = plan["steps"]
    assert (backend["budget"], mcp["budget"], comfy["budget"]) == (18 * GIB, 0, 8 * GIB)
    assert comfy["free_before"] == int(23.5 * GIB) - 18 * GIB and "lease" in comfy["note"]
    assert backend["engine"] == engine and backend["sleep_api"] == engine and mcp["engine"] is None
    # vLLM and SGLang take a fraction of the card's total: 18 GiB of 24 GiB is 0.75; ours takes the size itself
    assert after(backend["command"], flag) == ("18GiB" if engine == "scriptorium" else "0.75")
    if program:
        assert program in backend["command"][:3]
    if engine == "vllm":
        assert backend["env"] == {"VLLM_SERVER_DEV_MODE": "1"} and "--enable-sleep-mode" in backend["command"]
        assert "pip install vllm" in (backend["missing"] or "pip install vllm")
    docker = json.loads(run_ops(tmp_path, "plan", "--json", "--runner", "docker", env=env).stdout)["steps"][0]
    assert docker["image"] == image and after(docker["command"], flag) == after(backend["command"], flag)
    assert docker["command"][:2] == (["vllm", "serve"] if engine == "vllm" else docker["command"][:2])
    text = run_ops(tmp_path, "plan", env={**env, "SCRIPTORIUM_BACKEND_GPU_MEMORY": "0.3"})
    assert f"engine {engine}, sleep_api {engine}" in text.stdout
    assert f"{flag} 0.3" in text.stdout  # a fraction budget is passed as it is


def test_an_unknown_engine_names_the_choices(tmp_path):
    result = run_ops(tmp_path, "plan", env={"SCRIPTORIUM_ENGINE": "tgi"})
    assert result.returncode == 2
    assert "engines/tgi.yaml, which does not exist; choose one of scriptorium, sglang, vllm" in result.stderr


def test_sleep_api_none_means_comfyui_must_fit_beside_the_llm(tmp_path, gpu_file):
    compose = tmp_path / "compose.yaml"
    compose.write_text(f"""
services:
  backend:
    extends: {{file: {ROOT}/engines/vllm.yaml, service: backend}}
    deploy: {{resources: {{reservations: {{devices: [{{driver: nvidia, count: all, capabilities: [gpu]}}]}}}}}}
    x-ops: {{gpu_memory: 0.45, memory: fixed, sleep_api: none}}
  comfyui:
    image: comfyui
    depends_on: [backend]
    x-ops: {{gpu_memory: "${{COMFY:-8GiB}}", memory: elastic}}
""")
    fits = run_ops(tmp_path, "--file", str(compose), "plan", "--json", env=gpu_file(24, 23.5))
    comfy = json.loads(fits.stdout)["steps"][1]
    assert fits.returncode == 0 and "fits beside backend (sleep_api: none: no memory leases)" in comfy["note"]
    too_big = run_ops(tmp_path, "--file", str(compose), "plan", env={**gpu_file(24, 23.5), "COMFY": "16GiB"})
    assert too_big.returncode == 2
    assert "backend (vllm) has x-ops.sleep_api: none, so it cannot lend its memory and comfyui's budget must " \
           "fit beside it" in too_big.stderr
    assert "while the LLM sleeps" not in too_big.stdout
    one_setting = run_ops(tmp_path, "plan", "--profile", "image", "--json",  # compose.yaml: the setting says none
                          env={**gpu_file(24, 23.5), "SCRIPTORIUM_ENGINE": "vllm", "SCRIPTORIUM_LLM_SLEEP_API": "none"})
    backend, _, comfy = json.loads(one_setting.stdout)["steps"]
    assert backend["sleep_api"] == "none" and "fits beside backend" in comfy["note"]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_process_runner_runs_the_planned_command_and_names_what_to_install(tmp_path, gpu_file, engine):
    port = free_port()
    record = tmp_path / "record.json"
    env = {**gpu_file(24, 23.5), "SCRIPTORIUM_ENGINE": engine, "SCRIPTORIUM_BACKEND_GPU_MEMORY": "6GiB",
           "SCRIPTORIUM_BACKEND_PORT": str(port), "STANDIN_RECORD": str(record)}
    missing = run_ops(tmp_path, "up", "backend", env=env)
    assert missing.returncode == 1 and not (tmp_path / "state" / "backend.json").exists()
    assert ("pip install vllm" if engine == "vllm" else 'pip install "sglang[all]"') in missing.stderr
    assert "--runner docker" in missing.stderr
    env.update(standin_env(tmp_path / "standins"))
    planned = json.loads(run_ops(tmp_path, "plan", "backend", "--json", env=env).stdout)["steps"][0]
    assert planned["missing"] is None
    try:
        up = run_ops(tmp_path, "up", "backend", env=env)
        assert up.returncode == 0, up.stderr
        started = json.loads(record.read_text())
        tail = planned["command"][1:] if engine == "vllm" else planned["command"][3:]
        assert started["argv"][-len(tail):] == tail
        flag = ENGINES[engine][0]
        assert after(started["argv"], flag) == "0.25"  # 6 GiB of a 24 GiB card
        if engine == "vllm":
            assert started["env"]["VLLM_SERVER_DEV_MODE"] == "1"
            assert httpx.get(f"http://127.0.0.1:{port}/is_sleeping").json() == {"is_sleeping": False}
        else:
            assert httpx.get(f"http://127.0.0.1:{port}/get_server_info").json()["enable_memory_saver"] is True
        status = json.loads(run_ops(tmp_path, "status", "--json", env=env).stdout)
        assert [s["state"] for s in status["services"] if s["service"] == "backend"] == ["healthy"]
    finally:
        run_ops(tmp_path, "down", env=env)


def test_systemd_docker_units_run_the_engines_entrypoint_with_the_converted_budget(tmp_path, gpu_file):
    env = {**gpu_file(24, 23.5), "SCRIPTORIUM_ENGINE": "vllm", "SCRIPTORIUM_BACKEND_GPU_MEMORY": "12GiB"}
    out = tmp_path / "units"
    result = run_ops(tmp_path, "systemd", "print", "--output", str(out), "--runner", "docker", env=env)
    assert result.returncode == 0, result.stderr
    start = next(line for line in (out / "scriptorium-backend.service").read_text().splitlines()
                 if line.startswith("ExecStart="))
    assert "--ipc host --entrypoint vllm vllm/vllm-openai:latest serve HuggingFaceTB/SmolLM2-135M-Instruct" in start
    assert "--gpu-memory-utilization 0.5 --enable-sleep-mode" in start and "VLLM_SERVER_DEV_MODE=1" in start
