"""The server's life as a process: loading, refusing to start, draining on SIGTERM, and a server of its own for
speculation (test_server.py drives one shared server through its API)."""

import asyncio
import signal
import time

import httpx
import pytest

from tests.backend.server_process import ServerProcess, error_of, metric
from tests.reliability.server_state import idle


def test_loading_is_503_with_retry_after(smollm2_path):
    # Requests wait up to --load-timeout for their model (test_multi_model); with none they are told to retry.
    proc = ServerProcess("smollm2", "--load-timeout", "0", wait=False)
    try:
        deadline = time.monotonic() + 60
        first = None
        while time.monotonic() < deadline and first is None:
            try:
                first = httpx.get(f"{proc.url}/health", timeout=2)
            except httpx.TransportError:
                time.sleep(0.05)
        assert first is not None and first.status_code == 503 and first.json() == {"status": "loading"}
        assert first.headers["retry-after"]
        r = httpx.post(f"{proc.url}/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and error_of(r)["type"] == "service_unavailable" and r.headers["retry-after"]
        proc.wait_ready()
        r = httpx.post(f"{proc.url}/v1/completions", json={"model": "smollm2", "prompt": "The capital of France is",
                                                            "max_tokens": 3, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith(" Paris.")
    finally:
        assert proc.stop() == 0


def test_sigterm_finishes_in_flight_requests_and_exits_0(tiny_dir):
    proc = ServerProcess(str(tiny_dir("llama")), "--shutdown-timeout", "20")

    async def long_request():
        async with httpx.AsyncClient(timeout=60) as http:
            return await http.post(f"{proc.url}/v1/completions", json={
                "prompt": "The scribe", "max_tokens": 200, "temperature": 0, "ignore_eos": True})

    async def main():
        task = asyncio.create_task(long_request())
        # the signal while the request runs on the engine (a fixed pause could come before it arrived or after
        # the tiny model had finished it)
        deadline = time.monotonic() + 30
        while not (await asyncio.to_thread(idle, proc.url))["running"]:
            assert time.monotonic() < deadline and not task.done(), "the request never ran"
            await asyncio.sleep(0.01)
        started = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        response = await task
        code = await asyncio.to_thread(proc.proc.wait, 30)
        return response, code, time.monotonic() - started

    try:
        response, code, elapsed = asyncio.run(main())
    finally:
        proc.stop()  # when main failed before its SIGTERM (it has exited otherwise)
    assert code == 0 and elapsed < 20
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{proc.url}/health", timeout=2)


def test_bad_model_exits_nonzero_with_a_message(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "backend", "serve", "--model", str(tmp_path / "nope")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "neither a known alias" in result.stderr
    # a dtype no model can take, refused before the port is taken (the model is found first)
    result = subprocess.run([sys.executable, "-m", "backend", "serve", "--device", "cpu", "--dtype", "float16"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "dtype float16 is not supported on the CPU" in result.stderr


def test_speculative_server_reports_acceptance(tiny_dir):
    model_dir = tiny_dir("llama")
    proc = ServerProcess(str(model_dir), "--served-model-name", "tiny",
                         "--speculative", f'{{"method": "draft", "model": "{model_dir}", "num_tokens": 3}}')
    try:
        r = httpx.post(f"{proc.url}/v1/completions", json={"prompt": "The scribe", "max_tokens": 20, "temperature": 0,
                                                            "ignore_eos": True}, timeout=60)
        assert r.status_code == 200
        assert metric(proc, "scriptorium_spec_draft_tokens_total") > 0
        assert metric(proc, "scriptorium_spec_acceptance_rate", method="draft") == 1.0  # the target drafting for itself
        assert metric(proc, "scriptorium_spec_mean_accepted_length") > 2
    finally:
        assert proc.stop() == 0
    import subprocess
    import sys

    bad = subprocess.run([sys.executable, "-m", "backend", "serve", "--model", str(model_dir), "--speculative",
                          '{"method": "eagle"}'], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "method 'eagle' is not supported" in bad.stderr
