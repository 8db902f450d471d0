"""Memory leases with the real backend, the ComfyUI stand-in and a simulated card that follows them."""

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from common.settings import Settings
from orchestrator import api
from orchestrator.clients.llm_client import LLMClient
from orchestrator.jobs import JobStore
from tests.backend.server_process import ServerProcess
from tests.ops.conftest import run_ops
from tests.ops.lease_world import SimulatedCard, events, render

GIB = 2**30


@pytest.fixture
def backend(tiny_server):
    """The module's backend, awake for each test (a failed one may have left it asleep)."""
    httpx.post(f"{tiny_server.url}/wake_up", timeout=30)
    yield tiny_server
    httpx.post(f"{tiny_server.url}/wake_up", timeout=30)


@pytest.fixture
def world(tmp_path, backend, comfyui, monkeypatch):
    """Settings, the simulated card (12 GiB: the LLM's 10 leave 2, an sd15 image needs 4) and the events log."""
    probe = tmp_path / "gpu.json"
    monkeypatch.setenv("SCRIPTORIUM_GPU_PROBE_FILE", str(probe))
    monkeypatch.setenv("SCRIPTORIUM_LEASE_IDLE", "1")
    monkeypatch.setenv("SCRIPTORIUM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SCRIPTORIUM_LLM_URL", f"{backend.url}/v1")
    monkeypatch.setenv("SCRIPTORIUM_COMFYUI_URL", comfyui.url)
    card = SimulatedCard(probe, backend.url, comfyui.url, total=12, llm=10)
    settings = Settings.from_env()
    yield settings, card
    card.close()


def test_a_job_that_fits_runs_without_a_sleep(world, backend):
    settings, card = world
    card.total = 24  # 14 GiB free: plenty
    card.write()
    assert render(settings)["images"]
    assert events(settings) == ["fits"]
    assert httpx.get(f"{backend.url}/is_sleeping").json() == {"is_sleeping": False}


def test_a_job_that_does_not_fit_borrows_the_card_and_llm_calls_wait(world, backend, comfyui):
    settings, card = world
    comfyui.behave(hang=True)

    async def scenario():
        job = asyncio.create_task(asyncio.to_thread(render, settings))
        deadline = time.monotonic() + 30
        while "memory-free" not in events(settings) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert httpx.get(f"{backend.url}/is_sleeping").json() == {"is_sleeping": True}
        async with LLMClient(f"{backend.url}/v1", model="tiny") as llm:  # asked while the LLM sleeps
            reply = asyncio.create_task(llm.chat([{"role": "user", "content": "hi"}], max_tokens=4))
            await asyncio.sleep(1.0)
            assert not reply.done()
            comfyui.behave()  # the render finishes; after 1 s idle the card goes back
            result = await job
            answer = await reply
        return result, answer

    result, answer = asyncio.run(scenario())
    assert result["images"] and answer["usage"]["completion_tokens"] > 0
    assert events(settings) == ["sleep", "memory-free", "job-done", "idle", "free", "wake"]
    assert any(c["path"] == "/free" for c in comfyui.calls())
    assert card.peak_used <= card.total  # the LLM woke only once ComfyUI's model was off the card
    assert httpx.get(f"{backend.url}/is_sleeping").json() == {"is_sleeping": False}
    assert not (settings.home / "state" / "lease.json").exists()


def test_two_concurrent_image_jobs_share_one_lease(world, comfyui):
    settings, _ = world
    comfyui.behave(hang=True)
    first = api.start_image({"prompt": "one", "steps": 2}, settings)
    store = JobStore(settings.jobs_db)
    deadline = time.monotonic() + 60
    while "memory-free" not in events(settings) and time.monotonic() < deadline:
        time.sleep(0.1)
    second = api.start_image({"prompt": "two", "steps": 2}, settings)
    while "share" not in events(settings) and time.monotonic() < deadline:
        time.sleep(0.1)
    comfyui.behave()
    while time.monotonic() < deadline and not ("wake" in events(settings) and
                                               all(store.get(r.id).status == "done" for r in (first, second))):
        time.sleep(0.2)
    log = events(settings)
    assert log.count("sleep") == 1 and log.count("share") == 1 and log.count("wake") == 1
    assert log.index("wake") > max(i for i, e in enumerate(log) if e == "job-done")


def test_a_coordinator_killed_mid_lease_is_repaired_by_ops_health(world, backend, comfyui):
    settings, _ = world
    comfyui.behave(hang=True)
    run = api.start_image({"prompt": "doomed", "steps": 2}, settings)
    deadline = time.monotonic() + 60
    while "memory-free" not in events(settings) and time.monotonic() < deadline:
        time.sleep(0.1)
    os.kill(JobStore(settings.jobs_db).get(run.id).pid, signal.SIGKILL)
    time.sleep(0.3)
    assert httpx.get(f"{backend.url}/is_sleeping").json() == {"is_sleeping": True}
    status = json.loads(run_ops(settings.home, "status", "--json").stdout)
    assert status["lease"]["llm_asleep"] is True
    health = run_ops(settings.home, "health")
    assert health.returncode == 1 and "held by processes that are gone" in health.stderr
    assert httpx.get(f"{backend.url}/is_sleeping").json() == {"is_sleeping": False}
    assert events(settings)[-2:] == ["free", "wake"]
    comfyui.behave()


def test_a_backend_that_refuses_to_sleep_fails_the_job_and_keeps_serving(tmp_path, tiny_dir, comfyui, monkeypatch):
    stubborn = ServerProcess(str(tiny_dir("llama")), "--served-model-name", "tiny", "--no-sleep")
    probe = tmp_path / "gpu.json"
    monkeypatch.setenv("SCRIPTORIUM_GPU_PROBE_FILE", str(probe))
    monkeypatch.setenv("SCRIPTORIUM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SCRIPTORIUM_LLM_URL", f"{stubborn.url}/v1")
    monkeypatch.setenv("SCRIPTORIUM_COMFYUI_URL", comfyui.url)
    card = SimulatedCard(probe, stubborn.url, comfyui.url, total=12, llm=10)
    try:
        settings = Settings.from_env()
        with pytest.raises(Exception, match="refused to sleep \\(409: .*--no-sleep"):
            render(settings)
        run = JobStore(settings.jobs_db).recent(1)[0]
        assert run.status == "failed" and "refused to sleep" in run.error
        reply = httpx.post(f"{stubborn.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert reply.status_code == 200  # the LLM kept serving
        assert events(settings) == ["sleep", "refused"]
    finally:
        card.close()
        stubborn.stop()
