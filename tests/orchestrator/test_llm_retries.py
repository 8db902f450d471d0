"""LLMClient's retries (orchestrator/clients/retries.py) against a scripted upstream speaking the OpenAI chat
protocol (a real uvicorn server on 127.0.0.1): what is tried again, how often, and what never is, for plain
requests and streams alike."""

import asyncio
import json
import threading

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from orchestrator.clients.llm_client import LLMClient, LLMError
from tests.backend.server_process import free_port
from tests.serving import wait_healthy

ANSWER = {"id": "c", "object": "chat.completion", "model": "m",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "ink"}, "finish_reason": "stop"}]}


def _chunk(text: str) -> str:
    return "data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "model": "m",
                                  "choices": [{"index": 0, "delta": {"content": text}}]}) + "\n\n"


def scripted_app(script: list[str], seen: list[str]) -> FastAPI:
    """Each chat request takes the next step of the script (the last repeats): "ok", "busy" (503 with
    Retry-After: 0), "500", "502", "429", "400", "broken500" (a 500 whose body breaks off), "drop" (a stream whose connection drops before any text), "half" (one
    delta, then the connection drops)."""
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        step = script[min(len(seen), len(script) - 1)]
        seen.append(step)
        if step == "busy":
            return JSONResponse({"error": {"message": "asleep"}}, 503, headers={"Retry-After": "0"})
        if step in ("500", "502", "429", "400"):
            return JSONResponse({"error": {"message": f"scripted {step}"}}, int(step))
        if step == "broken500":  # a 500 whose own body breaks off

            async def half_error():
                yield b'{"error": {"mess'
                raise RuntimeError("the upstream died while answering its error")

            return StreamingResponse(half_error(), status_code=500, media_type="application/json")
        if not body.get("stream"):
            return ANSWER

        async def events():
            if step == "drop":
                raise RuntimeError("the upstream died before answering")
            yield _chunk("in")
            if step == "half":
                raise RuntimeError("the upstream died mid-answer")
            yield _chunk("k")
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture
def upstream():
    """upstream(script) -> (base URL, the steps taken so far)."""
    servers = []

    def start(script: list[str]):
        seen: list[str] = []
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(scripted_app(script, seen), host="127.0.0.1", port=port,
                                              log_level="critical"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
        wait_healthy(f"http://127.0.0.1:{port}", 120)
        return f"http://127.0.0.1:{port}/v1", seen

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(10)


def ask(url: str, stream: bool, **client) -> str:
    async def go():
        async with LLMClient(url, model="m", **client) as llm:
            messages = [{"role": "user", "content": "a word"}]
            if stream:
                return "".join([d async for d in llm.stream_chat(messages)])
            return (await llm.chat(messages))["text"]

    return asyncio.run(go())


@pytest.mark.parametrize("stream", [False, True])
def test_failures_before_the_answer_are_retried(upstream, stream):
    script = ["busy", "500", "broken500", "429", "drop" if stream else "502", "ok"]
    url, seen = upstream(script)
    assert ask(url, stream) == "ink"
    assert seen == script


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_error_is_never_retried(upstream, stream):
    url, seen = upstream(["400", "ok"])
    with pytest.raises(LLMError, match="answered 400: scripted 400"):
        ask(url, stream)
    assert seen == ["400"]


@pytest.mark.parametrize("stream", [False, True])
def test_retries_stop_at_max_retries_but_a_sleeping_backend_is_waited_out(upstream, stream):
    url, seen = upstream(["500"])
    with pytest.raises(LLMError, match=r"failed after 3 attempts .*last: 500: scripted 500"):
        ask(url, stream, max_retries=2)
    assert len(seen) == 3
    url, seen = upstream(["busy"] * 5 + ["ok"])
    assert ask(url, stream, max_retries=2) == "ink" and len(seen) == 6


def test_a_stream_cut_after_its_first_text_is_not_asked_again(upstream):
    url, seen = upstream(["half", "ok"])
    with pytest.raises(LLMError, match="broke off before the answer was complete"):
        ask(url, stream=True)
    assert seen == ["half"]
