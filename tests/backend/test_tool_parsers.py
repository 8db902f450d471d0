"""Each family's tool-call parser on fixed model texts: well-formed, several calls, malformed, and the same
text streamed a character (or a few) at a time, which must add up to the whole-text reading."""

import json

import pytest

from backend.server.tools.output import ToolCallStream, parse_message
from backend.server.tools.parsers import (
    HermesParser,
    JsonArrayParser,
    Llama3JsonParser,
    MistralParser,
    NamedParser,
    Phi4MiniParser,
)
from backend.server.tools.select import parser_name

WEATHER = {"city": "Paris", "days": [1, {"note": "a } and a \" inside"}]}


def whole(parser, text: str) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = parse_message(parser, text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def streamed(parser, text: str, step: int) -> tuple[str, list[tuple[str, dict]]]:
    reader, content, calls = ToolCallStream(parser), "", {}
    deltas = [reader.feed(text[i:i + step]) for i in range(0, len(text), step)] + [reader.finish()]
    for delta in deltas:
        content += delta.content
        for piece in delta.tool_calls:
            call = calls.setdefault(piece["index"], {"name": None, "arguments": ""})
            if "id" in piece:  # the first piece of a call carries its id, type and name
                assert call["name"] is None and piece["type"] == "function" and piece["id"].startswith("call_")
                call["name"] = piece["function"]["name"]
            else:
                assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
            call["arguments"] += piece["function"]["arguments"]
    return content, [(c["name"], json.loads(c["arguments"])) for c in calls.values()]


CASES = [
    # (parser, text, content, calls)
    (HermesParser, "Hello there, no tools today.", "Hello there, no tools today.", []),
    (HermesParser, f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(WEATHER)}}}\n</tool_call>',
     "", [("get_weather", WEATHER)]),
    (HermesParser, 'Let me look.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
     '{"name": "b", "arguments": {"x": 1}}\n</tool_call>', "Let me look.", [("a", {}), ("b", {"x": 1})]),
    (HermesParser, '<tool_call>{"name": "a", "arguments": "{\\"x\\": 2}"}</tool_call>', "", [("a", {"x": 2})]),
    (HermesParser, '<tool_call>{"arguments": {"x": 2}, "name": "late"}</tool_call>', "", [("late", {"x": 2})]),
    (HermesParser, '<tool_call>{"name": "no_args"}</tool_call>', "", [("no_args", {})]),
    (HermesParser, "<tool_call>not json</tool_call> then text", "<tool_call>not json</tool_call> then text", []),
    (HermesParser, 'a < b, and <tool_ca', "a < b, and <tool_ca", []),
    (HermesParser, '<tool_call>{"id": 1}</tool_call>', '<tool_call>{"id": 1}</tool_call>', []),
    (Llama3JsonParser, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", {"city": "Paris"})]),
    (Llama3JsonParser, '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"q": true}}', "",
     [("a", {}), ("b", {"q": True})]),
    (Llama3JsonParser, 'The answer is {"name": 1}', 'The answer is {"name": 1}', []),
    (Llama3JsonParser, "{not a call}", "{not a call}", []),
    (MistralParser, '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]', "",
     [("a", {"x": 1}), ("b", {})]),
    (MistralParser, 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]b[ARGS]{}', "Sure.",
     [("get_weather", {"city": "Paris"}), ("b", {})]),
    (MistralParser, "[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
    (MistralParser, "No calls [here]", "No calls [here]", []),
    (JsonArrayParser, '[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": "z"}}]', "",
     [("a", {"x": 1}), ("b", {"y": "z"})]),
    (Phi4MiniParser, f'<|tool_call|>[{{"name": "get_weather", "arguments": {json.dumps(WEATHER)}}}]<|/tool_call|>',
     "", [("get_weather", WEATHER)]),
    # the forms the model also writes: bare objects separated by commas, no closing marker; vLLM's functools[...]
    (Phi4MiniParser, '<|tool_call|>{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}', "",
     [("a", {}), ("b", {"x": 1})]),
    (Phi4MiniParser, 'Checking. functools[{"name": "a", "arguments": {"q": "[x]"}}]', "Checking.", [("a", {"q": "[x]"})]),
    (Phi4MiniParser, '<|tool_call|>{"name": "a", "arguments": {}}<|/tool_call|>Done.', "Done.", [("a", {})]),
    (Phi4MiniParser, "I use <|tool_call|> markers and functools.", "I use <|tool_call|> markers and functools.", []),
    (Phi4MiniParser, "<|tool_call|>not json", "<|tool_call|>not json", []),
]


@pytest.mark.parametrize("parser, text, content, calls", CASES, ids=[f"{c[0].name}-{i}" for i, c in enumerate(CASES)])
def test_parser_whole_and_streamed(parser, text, content, calls):
    assert whole(parser(), text) == (content, calls)
    for step in (1, 3, len(text)):
        assert streamed(parser(), text, step) == (content, calls)


@pytest.mark.parametrize("parser, text", [
    (HermesParser, '<tool_call>{"name": "a", "arguments": {"x": 1}'),  # cut off by max_tokens
    (HermesParser, '<tool_call>{"name": "a", "arguments": {"x": 1}]}</tool_call>'),  # brackets that do not match
    (Llama3JsonParser, '{"name": "a", "parameters": {"x": '),
    (MistralParser, '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}'),
    (Phi4MiniParser, '<|tool_call|>[{"name": "a", "arguments": {"x": 1}'),
])
def test_broken_calls_stay_content(parser, text):
    content, calls = parse_message(parser(), text)
    assert calls == [] and content == text


def test_special_tokens_are_stripped_from_content_but_markers_kept():
    strip = ("<|eom_id|>", "<|eot_id|>", "<|python_tag|>")
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}<|eom_id|>'
    assert whole(Llama3JsonParser(strip), text) == ("", [("a", {"x": 1})])
    assert streamed(Llama3JsonParser(strip), text, 2) == ("", [("a", {"x": 1})])
    assert whole(MistralParser(("</s>", "[TOOL_CALLS]")), "Plain answer.</s>") == ("Plain answer.", [])


@pytest.mark.parametrize("text, expected", [
    ('[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "argu', [("a", '{"x": 1}'), ("b", "")]),
    ('[{"name": "a", "arguments": {"x": 1', [("a", '{"x": 1')]),
    ('[{"name": "', []),
])
def test_a_call_cut_short_by_max_tokens_stays_a_call_streamed_or_not(text, expected):
    """A grammar's array of calls ends where max_tokens cut it: the calls begun, the last with the arguments written
    so far (as OpenAI returns them), and none of the array's syntax as content; streamed and whole alike."""
    content, calls = parse_message(JsonArrayParser(), text)
    assert content == "" and [(c.name, c.arguments) for c in calls] == expected
    reader = ToolCallStream(JsonArrayParser())
    deltas = [reader.feed(text[i:i + 3]) for i in range(0, len(text), 3)] + [reader.finish()]
    assert "".join(d.content for d in deltas) == ""
    assert [(c.name, c.arguments) for c in reader.calls.values()] == expected
    content, calls = parse_message(NamedParser("f"), '{"city": "Par')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", '{"city": "Par')]


def test_named_parser_is_the_arguments():
    assert whole(NamedParser("get_weather"), '{"city": "Paris"}') == ("", [("get_weather", {"city": "Paris"})])
    assert streamed(NamedParser("get_weather"), '{"city": "Paris"}', 2) == ("", [("get_weather", {"city": "Paris"})])


def test_parallel_false_keeps_the_first_call():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    content, calls = parse_message(HermesParser(), text, parallel=False)
    assert [c.name for c in calls] == ["a"]
    reader = ToolCallStream(HermesParser(), parallel=False)
    pieces = reader.feed(text).tool_calls + reader.finish().tool_calls
    assert {p["index"] for p in pieces} == {0}


def test_parser_is_chosen_from_the_template_then_the_family():
    assert parser_name(None, "{% for t in tools %}<tool_call>{% endfor %}", "Qwen2ForCausalLM") == "hermes"
    assert parser_name(None, "{{ '[TOOL_CALLS]' }}{{ tools }}", "MistralForCausalLM") == "mistral"
    assert parser_name(None, "<|python_tag|>{{ tools }}", "LlamaForCausalLM") == "llama3_json"
    assert parser_name(None, "{{ tools }}", "MistralForCausalLM") == "mistral"
    assert parser_name(None, "{{ messages }}", "LlamaForCausalLM") == "hermes"  # no tools: we write Hermes' format
    assert parser_name("mistral", "<tool_call>{{ tools }}", "Qwen2ForCausalLM") == "mistral"
    assert parser_name(None, PHI4_MINI_TEMPLATE, "Phi3ForCausalLM") == "phi4_mini_json"


# Phi-4-mini's template as its model card shows it: the functions are the system message's `tools` field.
PHI4_MINI_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and message['tools'] is "
    "not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' "
    "+ '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def test_phi4_minis_template_gets_the_functions_in_its_system_message_and_calls_back_as_text():
    from jinja2 import Template

    from backend.server.tools.conversation import template_input
    from backend.server.tools.tool_defs import ToolSpec

    function = {"name": "get_weather", "description": "Weather", "parameters": {"type": "object"}}
    spec = ToolSpec(tools=[{"type": "function", "function": function}], choice="auto")
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    messages, tools = template_input(history, spec, PHI4_MINI_TEMPLATE)
    prompt = Template(PHI4_MINI_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    assert tools is None
    assert prompt == ('<|system|><|tool|>' + json.dumps([function]) + '<|/tool|><|end|><|user|>Weather in Paris?<|end|>'
                      '<|assistant|><|tool_call|>[{"name": "get_weather", "arguments": {"city": "P"}}]<|/tool_call|>'
                      '<|end|><|tool_response|>sunny<|end|><|assistant|>')
