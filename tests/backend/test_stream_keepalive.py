"""A stream whose prompt waits (here: behind another request, the engine taking one at a time, as a long prompt
keeps it busy) sends, every --stream-keepalive seconds, an event that agents' watchdogs count and that changes
nothing in the answer: an empty text delta on /v1/messages, response.in_progress on /v1/responses. Read with
the official SDKs, each answer is the one the same request gets when it does not wait."""

import asyncio
import json
import threading
import time

import anthropic
import openai
import pytest

from backend.engine.deltas import RequestDelta, SequenceDelta
from backend.server.chat import ChatTools
from backend.server.messages_stream import stream_message
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
        result["value"] = read(lambda event: timed.append((time.monotonic(), event)))

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    time.sleep(HOLD)
    released = time.monotonic()
    assert blocker.release(), "the blocking generation ended before the hold did: make it longer"
    thread.join(300)
    assert "value" in result, "the waiting stream did not finish"
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


async def prefill_then(text: str, steps: int = 20, step: float = 0.05):
    """What the engine gives a request whose prompt takes steps steps: a delta per step with no text (at least
    steps * step seconds in all), then the answer's."""
    for _ in range(steps):
        await asyncio.sleep(step)
        yield RequestDelta("r", [SequenceDelta(0, [], "")])
    yield RequestDelta("r", [SequenceDelta(0, [5, 6], text, finish_reason="stop")], finished=True)


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
