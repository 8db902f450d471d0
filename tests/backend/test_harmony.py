"""gpt-oss's harmony output read on exact texts: analysis as reasoning, final (and commentary to no one) as the
answer, commentary to functions.NAME as tool calls; whole and streamed in random pieces alike."""

import json
import random

import pytest

from backend.server.chat import ChatTools, message
from backend.server.harmony import HarmonyReader
from backend.server.protocol import ToolDef
from backend.server.reasoning import reasoning_format, split_reasoning
from backend.server.tools.tool_defs import check_tools
from tests.backend.test_reasoning import fed_in_pieces

FINAL = "<|start|>assistant<|channel|>final<|message|>"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CASES = [  # (the output after the generation prompt's `<|start|>assistant`, reasoning, answer)
    (
        f"<|channel|>analysis<|message|>Weigh a and b.<|end|>{FINAL}The answer.<|return|>",
        "Weigh a and b.",
        "The answer.",
    ),
    (
        f"<|channel|>analysis<|message|>Short.<|end|>{FINAL}Cut by the stop token",
        "Short.",
        "Cut by the stop token",
    ),
    (
        "<|channel|>analysis<|message|>Ask the tool.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
        "Ask the tool.",
        CALL,
    ),
    # the recipient in the role's part of the header, the call cut by its stop token
    (
        "<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json"
        '<|message|>{"city": "Paris"}',
        "x",
        CALL,
    ),
    # a preamble (commentary to no one) is for the user: answer text
    (f"<|channel|>commentary<|message|>Checking. <|end|>{FINAL}Done.", None, "Checking. Done."),
    ("<|channel|>analysis<|message|>still thinking <|chan", "still thinking <|chan", ""),
    ("no harmony <at all> here", None, "no harmony <at all> here"),
    ("<|channel|>final<|message|>a <|end of nothing|> b", None, "a <|end of nothing|> b"),
    ("", None, ""),
]


def streamed(text: str, seed: int) -> tuple[str, str]:
    return fed_in_pieces(HarmonyReader(), text, seed, 5)


@pytest.mark.parametrize("text,reasoning,answer", CASES)
def test_harmony_channels_split_whole_and_streamed_alike(text, reasoning, answer):
    assert split_reasoning("harmony", text) == (reasoning, answer)
    for seed in range(40):
        assert streamed(text, seed) == (reasoning or "", answer)


def test_a_harmony_template_chooses_the_harmony_reader():
    template = (
        "{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>{{ m.content }}<|end|>"
        "{% endfor %}<|start|>assistant"
    )
    assert reasoning_format(None, template) == reasoning_format("auto", template) == "harmony"
    assert reasoning_format("none", template) is None
    assert reasoning_format("harmony", "{{ messages }}") == "harmony"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_a_commentary_call_after_the_reasoning_is_a_tool_call():
    text = CASES[2][0]
    spec = check_tools([ToolDef.model_validate(WEATHER)], "auto", None, None)
    tools = ChatTools(spec, "hermes", False, None, "harmony")
    msg, reason = message(tools, text, "stop")
    assert reason == "tool_calls" and msg["content"] is None and msg["reasoning_content"] == "Ask the tool."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("get_weather", {"city": "Paris"})
    ]
    for seed in range(20):  # streamed in random pieces through one reader: the same reasoning and call
        rng, reader, at, pieces = random.Random(seed), tools.new_reader(), 0, []
        while at < len(text):
            step = rng.randint(1, 6)
            pieces += reader.read(text[at : at + step], at + step >= len(text))
            at += step
        assert "".join(p.reasoning for p in pieces) == "Ask the tool." and not "".join(
            p.content for p in pieces
        )
        calls = [c for p in pieces for c in p.tool_calls]
        assert [c["function"]["name"] for c in calls if "id" in c] == ["get_weather"]
        assert (
            "".join(c["function"]["arguments"] for c in calls)
            == msg["tool_calls"][0]["function"]["arguments"]
        )
