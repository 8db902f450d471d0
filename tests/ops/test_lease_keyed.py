"""Memory leases with a backend started with --api-key: the image job's coordinator (detecting the sleep API, sleeping,
giving back) and `ops health`'s repairs send the key they are given (SCRIPTORIUM_LLM_API_KEY), so a keyed
backend lends its card as an open one does."""

import json
import time

import httpx
import pytest

from common.lease_file import LeaseFile
from common.settings import Settings
from tests.backend.server_process import ServerProcess
from tests.ops.conftest import run_ops
from tests.ops.lease_world import SimulatedCard, events, render

KEY = "lease-key"
BEARER = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_dir):
    server = ServerProcess(str(tiny_dir("llama")), "--served-model-name", "tiny", "--api-key", KEY)
    yield server
    server.stop()


def asleep(server) -> bool:
    return httpx.get(f"{server.url}/is_sleeping", headers=BEARER, timeout=5).json()["is_sleeping"]


@pytest.fixture
def backend(server):
    """The module's backend, awake for each test."""
    httpx.post(f"{server.url}/wake_up", headers=BEARER, timeout=60)
    yield server
    httpx.post(f"{server.url}/wake_up", headers=BEARER, timeout=60)


def test_an_image_job_borrows_and_gives_back_a_keyed_backend(tmp_path, backend, comfyui, monkeypatch):
    probe = tmp_path / "gpu.json"
    for name, value in {
        "SCRIPTORIUM_GPU_PROBE_FILE": str(probe),
        "SCRIPTORIUM_LEASE_IDLE": "1",
        "SCRIPTORIUM_HOME": str(tmp_path / "home"),
        "SCRIPTORIUM_LLM_URL": f"{backend.url}/v1",
        "SCRIPTORIUM_COMFYUI_URL": comfyui.url,
        "SCRIPTORIUM_LLM_API_KEY": KEY,
        "SCRIPTORIUM_LLM_SLEEP_API": "auto",
    }.items():
        monkeypatch.setenv(name, value)
    card = SimulatedCard(probe, backend.url, comfyui.url, total=12, llm=10, asleep=lambda: asleep(backend))
    try:
        settings = Settings.from_env()
        assert render(settings)["images"]  # 2 GiB free, the image needs 4: only a sleeping LLM makes it fit
        deadline = time.monotonic() + 30
        while "wake" not in events(settings) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        card.close()
    assert events(settings) == ["sleep", "memory-free", "job-done", "idle", "free", "wake"]
    assert card.peak_used <= card.total and not asleep(backend)
    assert not (settings.home / "state" / "lease.json").exists()


def test_ops_health_wakes_a_keyed_backend_with_or_without_a_lease(tmp_path, backend):
    env = {"SCRIPTORIUM_LLM_URL": f"{backend.url}/v1", "SCRIPTORIUM_LLM_API_KEY": KEY}
    httpx.post(f"{backend.url}/sleep", headers=BEARER, timeout=60).raise_for_status()
    health = run_ops(tmp_path, "health", env=env)
    assert "asleep with no lease: woken" in health.stderr and not asleep(backend)

    httpx.post(f"{backend.url}/sleep", headers=BEARER, timeout=60).raise_for_status()
    file = LeaseFile(tmp_path)
    with file.locked():  # a lease whose only holder is gone (no such pid)
        file.write(
            {
                "asleep": True,
                "since": time.time(),
                "expires": time.time() + 600,
                "holders": {"999999999": 1},
                "last_job_end": None,
                "backend": backend.url,
                "comfyui": None,
                "sleep_api": "scriptorium",
            }
        )
    health = run_ops(tmp_path, "health", "--json", env=env)
    assert "held by processes that are gone" in json.dumps(json.loads(health.stdout)["repaired"])
    assert not asleep(backend) and file.read() is None
