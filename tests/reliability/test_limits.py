"""Bounded inputs: a body-size cap answered before the body is read, the cap on n, and /health that
tells a dead or wedged engine from a working one."""

import asyncio
import json
import re
import threading
import time

import httpx
import pytest

from backend.config import EngineConfig
from backend.server.app import build_app
from tests.reliability.server_state import rss_bytes
from tests.serving import serve_in_thread, wait_healthy


def test_a_20mb_body_gets_413_in_openai_shape_and_health_stays_responsive(poison_server):
    url = poison_server.url
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * (20 << 20)}]}).encode()
    before = rss_bytes(poison_server.proc.pid)

    async def both():
        async with httpx.AsyncClient(timeout=60) as client:
            big = asyncio.ensure_future(client.post(f"{url}/v1/chat/completions", content=body,
                                                    headers={"content-type": "application/json"}))
            await asyncio.sleep(0.05)
            start = time.monotonic()
            health = await client.get(f"{url}/health")
            return await big, health, time.monotonic() - start

    big, health, health_seconds = asyncio.run(both())
    assert big.status_code == 413
    assert big.json()["error"]["code"] == "request_too_large" and "4194304 bytes" in big.json()["error"]["message"]
    assert health.status_code == 200 and health_seconds < 5
    assert rss_bytes(poison_server.proc.pid) - before < 100 << 20  # the body was never held


def test_a_chunked_body_without_length_is_cut_off_at_the_limit(poison_server):
    def chunks():
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(80):
            yield b"x" * (64 << 10)
        yield b'"}]}'

    response = httpx.post(f"{poison_server.url}/v1/chat/completions", content=chunks(),
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 413 and "limit" in response.json()["error"]["message"]
    assert httpx.get(f"{poison_server.url}/health").status_code == 200


def test_n_is_capped_by_max_n_and_n_at_the_cap_works(poison_server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 1.0}
    over = httpx.post(f"{poison_server.url}/v1/chat/completions", json={**body, "n": 17}, timeout=60)
    assert over.status_code == 400 and over.json()["error"]["param"] == "n"
    assert "at most 16" in over.json()["error"]["message"]
    at = httpx.post(f"{poison_server.url}/v1/chat/completions", json={**body, "n": 16}, timeout=120)
    assert at.status_code == 200 and sorted(c["index"] for c in at.json()["choices"]) == list(range(16))


@pytest.fixture
def inprocess(tiny_dir):
    """A real uvicorn server in this process, so a test can reach the engine behind it and break it."""
    app = build_app(EngineConfig(model=str(tiny_dir("llama")), block_size=8, max_model_len=128))
    server, thread, url = serve_in_thread(app)
    wait_healthy(url, 120)
    yield url, app.state.server
    server.should_exit = True
    thread.join(timeout=30)


def test_health_reports_a_dead_engine_loop_and_requests_fail_fast(inprocess):
    url, state = inprocess

    def broken(command):
        raise RuntimeError("simulated bug in the loop")

    state.engine._run_command = broken
    state.engine._submit(("abort", "nothing"))
    deadline = time.monotonic() + 10
    while state.engine.died is None and time.monotonic() < deadline:
        time.sleep(0.05)
    health = httpx.get(f"{url}/health", timeout=5)
    assert health.status_code == 503 and "simulated bug" in health.json()["error"]
    response = httpx.post(f"{url}/v1/chat/completions", timeout=10,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert response.status_code == 503 and "restart the server" in response.json()["error"]["message"]


def test_health_reports_an_engine_stuck_in_one_step(inprocess):
    url, state = inprocess
    engine = state.engine
    engine.stuck_after = 0.5
    release = threading.Event()
    step = engine.engine.step_deltas

    def hung_step():
        release.wait(30)
        return step()

    engine.engine.step_deltas = hung_step
    request = threading.Thread(target=httpx.post, args=(f"{url}/v1/chat/completions",), daemon=True,
                               kwargs={"json": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                                       "timeout": 60})
    request.start()
    time.sleep(1.5)
    stuck = httpx.get(f"{url}/health", timeout=5)
    release.set()
    request.join(timeout=30)
    assert stuck.status_code == 503 and "stuck in one step" in stuck.json()["error"]
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200


def test_a_request_that_fails_mid_generation_gets_its_500_alone_and_is_counted(inprocess, monkeypatch):
    import backend.engine.scheduler as scheduler

    url, _ = inprocess
    append = scheduler.append_token

    def faulty(seq, token, *args):
        if seq.params.max_tokens == 7:  # the marked request
            raise RuntimeError("simulated stop-string fault")
        return append(seq, token, *args)

    monkeypatch.setattr(scheduler, "append_token", faulty)
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True}

    async def both():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(client.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 7}),
                                        client.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 9}))

    marked, healthy = asyncio.run(both())
    assert marked.status_code == 500 and "simulated stop-string fault" in marked.json()["error"]["message"]
    assert healthy.status_code == 200 and healthy.json()["usage"]["completion_tokens"] == 9
    text = httpx.get(f"{url}/metrics").text
    assert re.search(r'^scriptorium_requests_total\{model="[^"]+",outcome="error"\} 1\.0$', text, re.M)
    assert httpx.get(f"{url}/health").status_code == 200
