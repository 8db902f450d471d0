"""A stream whose prompt waits (here: behind another request, the engine taking one at a time, as a long prompt
keeps it busy) sends, every --stream-keepalive seconds, an event that agents' watchdogs count and that changes
nothing in the answer: an empty text delta on /v1/messages, response.in_progress on /v1/responses, a chunk with
an empty content delta on /v1/chat/completions. Read with the official SDKs, each answer is the one the same
request gets when it does not wait."""

import asyncio
import json
import threading
import time

import anthropic
import openai
import pytest

from backend.engine.deltas import RequestDelta
from backend.outputs import CompletionOutput
from backend.server.chat import ChatTools
from backend.server.chat_stream import stream_chunks
from backend.server.messages_stream import stream_message
from backend.server.protocol import ChatRequest
from backend.server.responses_shapes import ResponsesRequest
from backend.server.responses_stream import stream_response
from backend.server.responses_tools import ToolNames
from tests.backend.blocking_request import Blocker
from tests.backend.server_process import ServerProcess
from tests.backend.tiny_models import build_model

HOLD = 8.0  # seconds the request waits: eight keepalive intervals
ASK = [{"role": "user", "content": "Tell me about the scribe and the ink."}]


def waiting(url: str, read) -> tuple[list, float, object]:
    """read() run while a Blocker holds the engine for HOLD seconds: its timed events, the release time, and
    its result."""
    blocker = Blocker(url, "tiny")
    timed, result = [], {}

    def reader():
        try:
            result["value"] = read(lambda event: timed.append((time.monotonic(), event)))
        except Exception as e:  # noqa: BLE001 named in the test's failure
            result["error"] = f"{type(e).__name__}: {e}"

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    time.sleep(HOLD)
    released = time.monotonic()
    assert blocker.release(), "the blocking generation ended before the hold did: make it longer"
    thread.join(300)
    assert "value" in result, result.get("error", "the waiting stream did not finish")
    return timed, released, result["value"]


@pytest.fixture(scope="module")
def one_at_a_time(tmp_path_factory):
    model = build_model("qwen2", tmp_path_factory.mktemp("keepalive") / "tiny", max_position_embeddings=32768)
    server = ServerProcess(
        str(model),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "32768",
        "--max-num-seqs",
        "1",
        "--stream-keepalive",
        "1",
    )
    yield server
    assert server.stop() == 0


def test_a_waiting_messages_stream_sends_empty_text_deltas_and_the_same_answer(one_at_a_time):
    client = anthropic.Anthropic(base_url=one_at_a_time.url, api_key="unused", max_retries=0, timeout=600)
    ask = dict(model="tiny", max_tokens=24, messages=ASK, extra_body={"temperature": 0})
    client.messages.create(
        **ask
    )  # the prompt's full blocks into the prefix cache, as the waiting one reads them
    alone = client.messages.create(**ask)

    def read(seen):
        with client.messages.stream(**ask) as stream:
            for event in stream:
                seen(event)
            return stream.get_final_message()

    timed, released, final = waiting(one_at_a_time.url, read)
    early = [e for t, e in timed if t < released]
    empty = [
        e
        for e in early
        if e.type == "content_block_delta" and e.delta.type == "text_delta" and not e.delta.text
    ]
    assert len(empty) >= 2, [e.type for e in early]
    assert [e.type for e in early if e.type not in ("content_block_delta", "text")] == [
        "message_start",
        "content_block_start",
    ]  # one block opened for them, the answer's own
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in alone.content]
    assert (final.stop_reason, final.usage.output_tokens) == (alone.stop_reason, alone.usage.output_tokens)


def test_a_waiting_responses_stream_sends_in_progress_and_the_same_answer(one_at_a_time):
    client = openai.OpenAI(base_url=f"{one_at_a_time.url}/v1", api_key="unused", max_retries=0, timeout=600)
    ask = dict(model="tiny", max_output_tokens=24, input=ASK, temperature=0)
    client.responses.create(**ask)
    alone = client.responses.create(**ask)

    def read(seen):  # the answer, cut by max_output_tokens, ends with response.incomplete
        with client.responses.create(**ask, stream=True) as stream:
            for event in stream:
                seen(event)
            return event.response

    timed, released, final = waiting(one_at_a_time.url, read)
    early = [e.type for t, e in timed if t < released]
    assert early[:2] == ["response.created", "response.in_progress"]
    assert early.count("response.in_progress") >= 3 and set(early) == {
        "response.created",
        "response.in_progress",
    }
    assert final.output_text == alone.output_text and final.status == alone.status
    assert [item.type for item in final.output] == [item.type for item in alone.output]


def test_a_waiting_chat_stream_sends_empty_content_chunks_and_the_same_answer(one_at_a_time):
    client = openai.OpenAI(base_url=f"{one_at_a_time.url}/v1", api_key="unused", max_retries=0, timeout=600)
    ask = dict(model="tiny", max_tokens=24, messages=ASK, temperature=0)
    client.chat.completions.create(**ask)
    alone = client.chat.completions.create(**ask)

    def read(seen):  # the answer assembled from the chunks, as a client appends their deltas
        text, reason, used = "", None, None
        for chunk in client.chat.completions.create(
            **ask, stream=True, stream_options={"include_usage": True}
        ):
            seen(chunk)
            for choice in chunk.choices:
                text += choice.delta.content or ""
                reason = choice.finish_reason or reason
            used = chunk.usage or used
        return text, reason, used

    timed, released, (text, reason, used) = waiting(one_at_a_time.url, read)
    early = [c for t, c in timed if t < released]
    assert early[0].choices[0].delta.role == "assistant"  # the stream's first chunk, before any wait
    kept = early[1:]
    assert len(kept) >= 2, early
    assert [(c.choices[0].delta.model_dump(exclude_none=True), c.choices[0].finish_reason) for c in kept] == [
        ({"content": ""}, None)
    ] * len(kept)
    answer = alone.choices[0]
    assert (text, reason) == (answer.message.content, answer.finish_reason)
    assert used.completion_tokens == alone.usage.completion_tokens


async def prefill_then(text: str, steps: int = 20, step: float = 0.05):
    """What the engine gives a request whose prompt takes steps steps: a delta per step with no text (at least
    steps * step seconds in all), then the answer's."""
    for _ in range(steps):
        await asyncio.sleep(step)
        yield RequestDelta("r", [CompletionOutput(0, "", [])])
    yield RequestDelta("r", [CompletionOutput(0, text, [5, 6], finish_reason="stop")], finished=True)


async def body(response) -> list[str]:
    return [chunk async for chunk in response.body_iterator]


def test_a_prompt_being_processed_is_no_silence_between_its_steps():
    """The engine's steps over a long prompt come more often than the keepalive, each with no text: the
    keepalive counts from the last event sent, not from the last step."""
    tools = ChatTools(None, "hermes", False, None)
    events = asyncio.run(
        body(stream_message("tiny", "msg_1", prefill_then("Paris."), 10, tools, keepalive=0.25))
    )
    empty = [e for e in events if '"text_delta", "text": ""' in e]
    assert len(empty) >= 2, events  # the steps took 1 s at the least
    texts = [json.loads(e.split("data: ", 1)[1])["delta"]["text"] for e in events if "text_delta" in e]
    assert "".join(texts) == "Paris." and sum(e.startswith("event: content_block_start") for e in events) == 1

    req = ResponsesRequest(model="tiny", input="The capital of France?")
    events = asyncio.run(
        body(
            stream_response(
                "tiny", req, "resp_1", 0.0, prefill_then("Paris."), 10, tools, ToolNames(), keepalive=0.25
            )
        )
    )
    kinds = [json.loads(e.split("data: ", 1)[1])["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds.count("response.in_progress") >= 3, kinds
    assert (
        json.loads(events[-1].split("data: ", 1)[1])["response"]["output"][0]["content"][0]["text"]
        == "Paris."
    )

    req = ChatRequest(
        model="tiny", messages=[{"role": "user", "content": "The capital of France?"}], stream=True
    )
    chunks = asyncio.run(
        body_of(
            stream_chunks("tiny", "chatcmpl-1", req, prefill_then("Paris."), [1] * 10, tools, keepalive=0.25)
        )
    )
    deltas = [json.loads(c.split("data: ", 1)[1])["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1:].count({"content": ""}) >= 2, deltas
    assert "".join(d.get("content", "") for d in deltas) == "Paris."


async def body_of(chunks) -> list[str]:
    return [chunk async for chunk in chunks]
