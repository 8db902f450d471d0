"""Interactive under load, on a real model that is slow on the CPU (SmolLM2): beside a long prompt, or a large
embeddings request, a running stream keeps getting tokens and a new request gets its first token within a few
steps, where it used to wait for the whole burden to be computed."""

import re
import threading
import time

import httpx
import pytest

from tests.backend.server_process import ServerProcess, stream_gaps

LONG_PROMPT = "The scribe copied the manuscript line by line, and the abbot read every page. " * 300  # ~5,100 tokens


@pytest.fixture(scope="module")
def smol(smollm2_path):
    server = ServerProcess("smollm2", "--served-model-name", "smol", "--max-model-len", "8192")
    yield server
    assert server.stop() == 0


def first_token_seconds(url: str) -> float:
    start = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", json={"model": "smol", "prompt": "Ink is", "max_tokens": 1}, timeout=600)
    r.raise_for_status()
    return time.monotonic() - start


def burden(url: str, kind: str) -> None:
    if kind == "long prompt":
        body = {"model": "smol", "prompt": LONG_PROMPT, "max_tokens": 1}
        httpx.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()
    else:  # eight inputs of ~1,500 tokens
        body = {"model": "smol", "input": [LONG_PROMPT[: 8000 + i] for i in range(8)]}
        httpx.post(f"{url}/v1/embeddings", json=body, timeout=600).raise_for_status()


@pytest.mark.parametrize("kind", ["long prompt", "embeddings"])
def test_a_new_request_starts_and_a_stream_goes_on_beside_a_burden(smol, kind):
    gaps: list[float] = []
    started = threading.Event()
    stream = threading.Thread(target=stream_gaps, args=(smol.url, "smol", 300, started, gaps))
    stream.start()
    assert started.wait(60)
    load = threading.Thread(target=burden, args=(smol.url, kind))
    load.start()
    time.sleep(1.0)  # the burden is under way
    assert load.is_alive()
    probe = first_token_seconds(smol.url)
    busy = load.is_alive()  # the burden was still being computed when the probe was answered
    load.join()
    stream.join()
    # The burden alone takes tens of seconds here; the probe waits a few steps of the time budget (0.25 s).
    assert busy and probe < 6.0, (probe, busy)
    assert max(gaps) < 3.0, [round(g, 2) for g in gaps]


def test_a_schemas_compile_time_counts_from_its_start_not_from_behind_another(smollm2_path):
    """A slow schema holds the grammar thread past the limit; a one-property schema sent meanwhile waits its turn
    and is compiled then, where it used to be refused after the limit spent in the queue."""
    server = ServerProcess("smollm2", "--served-model-name", "smol", "--max-model-len", "2048",
                           "--grammar-compile-timeout", "2")
    try:
        def ask(schema: dict) -> httpx.Response:
            body = {"model": "smol", "messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 4,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
            return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)

        slow: list[httpx.Response] = []
        first = threading.Thread(target=lambda: slow.append(ask({"type": "string", "pattern": "[a-z]{1,16000}"})))
        first.start()
        time.sleep(0.5)
        quick = ask({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})
        first.join()
        assert slow[0].status_code == 400 and "took longer than 2 s" in slow[0].text  # it alone runs past the limit
        assert quick.status_code == 200, quick.text
    finally:
        assert server.stop() == 0


def running(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(re.search(r'^scriptorium_requests_running\{model="smol"\} ([0-9.]+)$', text, re.M).group(1))


@pytest.mark.parametrize("stream", [False, True])
def test_a_gone_clients_long_prompt_is_aborted_within_a_step_or_two(smol, stream):
    """A client that hangs up during a long prompt's prefill: its request stops within a few seconds, where a
    step of the whole 2,048-token budget kept it running 24-44 s after the client had gone."""
    body = {"model": "smol", "prompt": f"{time.time()} {LONG_PROMPT}", "max_tokens": 50, "stream": stream}
    client = httpx.Client(timeout=httpx.Timeout(3.0, connect=10))
    with pytest.raises(httpx.ReadTimeout), client, client.stream("POST", f"{smol.url}/v1/completions", json=body) as r:
        for _ in r.iter_bytes():
            pass
    gone = time.monotonic()
    while running(smol.url) and time.monotonic() - gone < 60:
        time.sleep(0.1)
    assert running(smol.url) == 0 and time.monotonic() - gone < 6.0, time.monotonic() - gone
