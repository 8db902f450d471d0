"""The reasoning parser on exact texts: whole and streamed in random pieces alike, and tool calls read in the
answer alone (the reasoning's are not calls)."""

import json
import random

import pytest

from backend.server.chat import ChatTools, message
from backend.server.protocol import ToolDef
from backend.server.reasoning import (
    ThinkReader,
    effort_switches,
    opens_thinking,
    reasoning_format,
    split_reasoning,
)
from backend.server.tools.tool_defs import check_tools
from tests.backend.tiny_models import CHAT_TEMPLATE, TOOLS_CHAT_TEMPLATE

CASES = [  # (text, the prompt left a think block open, reasoning, answer)
    ("<think>\nweigh a and b\n</think>\n\nThe answer.", False, "weigh a and b", "The answer."),
    ("weigh it</think>answer", True, "weigh it", "answer"),
    ("  \n<think>x</think>", False, "x", ""),
    ("<think>\n\n</think>\n\nHi", False, None, "Hi"),  # enable_thinking false: an empty block, no reasoning
    ("  no think block at all  ", False, None, "  no think block at all  "),
    ("The tag </think> is text here", False, None, "The tag </think> is text here"),
    ("<thi", False, None, "<thi"),
    ("cut off mid </thi", True, "cut off mid </thi", ""),
    ("<think>a <think> b</think> c </think> d", False, "a <think> b", "c </think> d"),
    ("still thinking \n\n", True, "still thinking", ""),
    ("", True, None, ""),
]


def streamed(text: str, in_thinking: bool, seed: int) -> tuple[str, str]:
    return fed_in_pieces(ThinkReader(in_thinking), text, seed, 4)


def fed_in_pieces(reader, text: str, seed: int, longest: int) -> tuple[str, str]:
    """(reasoning, content) a streaming reader gives for the text fed in random pieces of 1 to longest characters."""
    rng, reasoning, content, at = random.Random(seed), "", "", 0
    while at < len(text):
        step = rng.randint(1, longest)
        delta = reader.feed(text[at : at + step])
        reasoning, content, at = reasoning + delta.reasoning, content + delta.content, at + step
    delta = reader.finish()
    return reasoning + delta.reasoning, content + delta.content


@pytest.mark.parametrize("text,in_thinking,reasoning,answer", CASES)
def test_think_blocks_split_whole_and_streamed_alike(text, in_thinking, reasoning, answer):
    assert split_reasoning("think", text, in_thinking) == (reasoning, answer)
    for seed in range(40):
        assert streamed(text, in_thinking, seed) == (reasoning or "", answer)
    assert split_reasoning(None, text, in_thinking) == (None, text)


def test_format_from_template_and_flag_and_effort_switches():
    qwen3_like = "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    assert reasoning_format(None, qwen3_like) == reasoning_format("auto", qwen3_like) == "think"
    assert reasoning_format("none", qwen3_like) is None
    assert reasoning_format("auto", TOOLS_CHAT_TEMPLATE) is reasoning_format(None, CHAT_TEMPLATE) is None
    assert reasoning_format("think", CHAT_TEMPLATE) == "think"
    assert opens_thinking("<|im_start|>assistant\n<think>\n") and not opens_thinking(
        "<think>\n\n</think>\n\n"
    )
    assert effort_switches("minimal") == effort_switches("none") == {"enable_thinking": False}
    assert effort_switches("high") == {"enable_thinking": True, "reasoning_effort": "high"}
    assert effort_switches(None) == {}


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
IN_THOUGHT = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
TEXT = (
    f"<think>\nI could call {IN_THOUGHT} but the weather is asked.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def tools(reasoning: str | None, in_thinking: bool = False) -> ChatTools:
    spec = check_tools([ToolDef.model_validate(WEATHER)], "auto", None, None)
    return ChatTools(spec, "hermes", False, None, reasoning, in_thinking)


def test_tool_calls_are_read_in_the_answer_only():
    msg, reason = message(tools("think"), TEXT, "stop")
    assert reason == "tool_calls" and msg["content"] is None
    assert (
        msg["reasoning_content"] == msg["reasoning"] == f"I could call {IN_THOUGHT} but the weather is asked."
    )
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("get_weather", {"city": "Paris"})
    ]
    # Streamed in random pieces, through one reader per choice: the same reasoning, the same one call
    for seed in range(20):
        rng, reader, at, pieces = random.Random(seed), tools("think").new_reader(), 0, []
        while at < len(TEXT):
            step = rng.randint(1, 6)
            pieces += reader.read(TEXT[at : at + step], at + step >= len(TEXT))
            at += step
        assert "".join(p.reasoning for p in pieces) == msg["reasoning_content"]
        assert not "".join(p.content for p in pieces)
        calls = [c for p in pieces for c in p.tool_calls]
        assert [c["function"]["name"] for c in calls if "id" in c] == ["get_weather"]
        assert (
            "".join(c["function"]["arguments"] for c in calls)
            == msg["tool_calls"][0]["function"]["arguments"]
        )
        assert reader.has_calls


def test_without_a_reasoning_format_the_message_is_as_before():
    msg, reason = message(tools(None), TEXT, "stop")
    assert "reasoning_content" not in msg and reason == "tool_calls"
    # with no reasoning format, the think block is text, and the call written in it is read as a call
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_time", "get_weather"]
    plain = ChatTools(None, "hermes", False, None)
    assert message(plain, "<think>x</think>y", "stop") == (
        {"role": "assistant", "content": "<think>x</think>y"},
        "stop",
    )
