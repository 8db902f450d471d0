"""Memory leases with any engine: our real backend spoken to as vLLM (the same endpoints), and the SGLang stand-in's
release/resume endpoints, with the simulated card following them; repair after the holder is killed."""

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from common.settings import Settings
from orchestrator import api
from orchestrator.jobs import JobStore
from tests.backend.server_process import ServerProcess
from tests.backend.tiny_models import build_model
from tests.ops.conftest import run_ops
from tests.ops.lease_world import SimulatedCard, events, render
from tests.ops.standin_env import StandinServer


def lease_env(monkeypatch, tmp_path, llm_url: str, comfyui_url: str, **extra) -> None:
    for key, value in {"SCRIPTORIUM_GPU_PROBE_FILE": str(tmp_path / "gpu.json"), "SCRIPTORIUM_LEASE_IDLE": "1",
                       "SCRIPTORIUM_HOME": str(tmp_path / "home"), "SCRIPTORIUM_LLM_URL": f"{llm_url}/v1",
                       "SCRIPTORIUM_COMFYUI_URL": comfyui_url, **extra}.items():
        monkeypatch.setenv(key, value)


def wait_for(settings: Settings, event: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while event not in events(settings):
        assert time.monotonic() < deadline, f"no {event} event: {events(settings)}"
        time.sleep(0.1)


def lease(settings: Settings) -> dict:
    return json.loads((settings.home / "state" / "lease.json").read_text())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model("llama", tmp_path_factory.mktemp("lease-engines-model") / "tiny")


def test_our_backend_lends_its_memory_through_the_vllm_sleep_api(tmp_path, model, comfyui, monkeypatch):
    backend = ServerProcess(str(model), "--served-model-name", "tiny")
    lease_env(monkeypatch, tmp_path, backend.url, comfyui.url, SCRIPTORIUM_LLM_SLEEP_API="vllm")
    card = SimulatedCard(tmp_path / "gpu.json", backend.url, comfyui.url, total=12, llm=10)
    try:
        settings = Settings.from_env()
        comfyui.behave(hang=True)

        async def scenario():
            job = asyncio.create_task(asyncio.to_thread(render, settings))
            await asyncio.to_thread(wait_for, settings, "memory-free")
            assert httpx.get(f"{backend.url}/is_sleeping").json() == {"is_sleeping": True}
            assert lease(settings)["sleep_api"] == "vllm"
            comfyui.behave()
            return await job

        assert asyncio.run(scenario())["images"]
        assert events(settings) == ["sleep", "memory-free", "job-done", "idle", "free", "wake"]
        log = (settings.home / "state" / "lease-events.log").read_text().splitlines()
        assert json.loads(log[0])["api"] == "vllm"
        assert httpx.get(f"{backend.url}/is_sleeping").json() == {"is_sleeping": False}
    finally:
        card.close()
        backend.stop()


def test_a_holder_killed_while_our_backend_sleeps_through_the_vllm_api_is_repaired(tmp_path, model, comfyui,
                                                                                  monkeypatch):
    backend = ServerProcess(str(model), "--served-model-name", "tiny")
    lease_env(monkeypatch, tmp_path, backend.url, comfyui.url, SCRIPTORIUM_LLM_SLEEP_API="vllm")
    card = SimulatedCard(tmp_path / "gpu.json", backend.url, comfyui.url, total=12, llm=10)

    def asleep() -> bool:
        return httpx.get(f"{backend.url}/is_sleeping", timeout=5).json()["is_sleeping"]

    try:
        settings = Settings.from_env()
        comfyui.behave(hang=True)
        run = api.start_image({"prompt": "doomed", "steps": 2}, settings)
        wait_for(settings, "memory-free")
        assert lease(settings)["sleep_api"] == "vllm"
        os.kill(JobStore(settings.jobs_db).get(run.id).pid, signal.SIGKILL)
        time.sleep(0.3)
        assert asleep()
        health = run_ops(settings.home, "health")
        assert health.returncode == 1 and "held by processes that are gone" in health.stderr
        assert not asleep() and events(settings)[-2:] == ["free", "wake"]
        comfyui.behave()
    finally:
        card.close()
        backend.stop()


@pytest.fixture
def sglang(tmp_path, comfyui, monkeypatch):
    """The SGLang stand-in with its memory saver on; the card counts its 10 GiB unless released (auto-detected)."""
    server = StandinServer("sglang", "--enable-memory-saver")
    lease_env(monkeypatch, tmp_path, server.url, comfyui.url)
    card = SimulatedCard(tmp_path / "gpu.json", server.url, comfyui.url, total=12, llm=10,
                         asleep=lambda: server.state()["asleep"])
    yield server, Settings.from_env()
    card.close()
    server.stop()


def test_sglang_releases_its_memory_for_an_image_job_and_resumes_after(sglang, comfyui):
    server, settings = sglang
    comfyui.behave(hang=True)

    async def scenario():
        job = asyncio.create_task(asyncio.to_thread(render, settings))
        await asyncio.to_thread(wait_for, settings, "memory-free")
        assert server.state()["asleep"] and lease(settings)["sleep_api"] == "sglang"
        comfyui.behave()
        return await job

    assert asyncio.run(scenario())["images"]
    assert events(settings) == ["sleep", "memory-free", "job-done", "idle", "free", "wake"]
    assert [(c["method"], c["body"]) for c in server.calls("/release_memory_occupation")] == [("POST", {})]
    assert [(c["method"], c["body"]) for c in server.calls("/resume_memory_occupation")] == [("POST", {})]
    assert not server.calls("/sleep") and not server.state()["asleep"]


def test_a_holder_killed_while_sglang_is_released_is_repaired_by_ops_health(sglang, comfyui):
    server, settings = sglang
    comfyui.behave(hang=True)
    run = api.start_image({"prompt": "doomed", "steps": 2}, settings)
    wait_for(settings, "memory-free")
    os.kill(JobStore(settings.jobs_db).get(run.id).pid, signal.SIGKILL)
    time.sleep(0.3)
    assert server.state()["asleep"]
    health = run_ops(settings.home, "health")
    assert health.returncode == 1 and "held by processes that are gone" in health.stderr
    assert not server.state()["asleep"] and len(server.calls("/resume_memory_occupation")) == 1
    assert events(settings)[-2:] == ["free", "wake"]
    comfyui.behave()


@pytest.mark.parametrize("kind,args,env,why", [
    ("sglang", (), {}, "SGLang was started without --enable-memory-saver"),
    ("vllm", ("--enable-sleep-mode",), {"VLLM_SERVER_DEV_MODE": "0"}, "VLLM_SERVER_DEV_MODE=1"),
])
def test_an_engine_without_its_sleep_mode_fails_the_job_and_is_left_alone(tmp_path, comfyui, monkeypatch, kind, args,
                                                                         env, why):
    server = StandinServer(kind, *args, env=env)
    lease_env(monkeypatch, tmp_path, server.url, comfyui.url)
    card = SimulatedCard(tmp_path / "gpu.json", server.url, comfyui.url, total=12, llm=10, asleep=lambda: False)
    try:
        settings = Settings.from_env()
        with pytest.raises(Exception, match="cannot lend its memory") as failure:
            render(settings)
        assert why in str(failure.value) and "fits beside" in str(failure.value)
        assert events(settings) == ["refused"]
        assert not server.calls("/release_memory_occupation") and not server.calls("/sleep")
    finally:
        card.close()
        server.stop()


def test_a_sleep_api_setting_of_none_never_sleeps_the_llm(tmp_path, comfyui, monkeypatch):
    server = StandinServer("vllm", "--enable-sleep-mode", env={"VLLM_SERVER_DEV_MODE": "1"})
    lease_env(monkeypatch, tmp_path, server.url, comfyui.url, SCRIPTORIUM_LLM_SLEEP_API="none")
    card = SimulatedCard(tmp_path / "gpu.json", server.url, comfyui.url, total=12, llm=10)
    try:
        with pytest.raises(Exception, match="SCRIPTORIUM_LLM_SLEEP_API is none"):
            render(Settings.from_env())
        assert not server.calls("/sleep") and not server.state()["asleep"]
    finally:
        card.close()
        server.stop()
