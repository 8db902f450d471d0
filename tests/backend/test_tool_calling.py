"""Tool calling in /v1/chat/completions against the real server, through the official openai client.

SmolLM2 (whose template knows no tools: the server writes the Hermes format into its prompt) answers
with a call whose arguments validate against the schema when tool_choice requires one; a tiny model with
Qwen 2.5's template (which knows tools) shows the template's own tools= path. Every bad input is a 400
naming its field.
"""

import json

import httpx
import jsonschema
import pytest

WEATHER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                            "parameters": WEATHER_SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def call_of(message) -> tuple[str, dict]:
    (call,) = message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    return call.function.name, json.loads(call.function.arguments)


def test_required_tool_call_round_trip(smol):
    first = smol.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                         parallel_tool_calls=False, temperature=0, max_tokens=60)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    name, arguments = call_of(choice.message)
    assert name in ("get_weather", "get_time")
    jsonschema.validate(arguments, WEATHER_SCHEMA if name == "get_weather" else TIME["function"]["parameters"])

    call = choice.message.tool_calls[0]
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18})}]
    final = smol.chat.completions.create(model="smol", messages=history, tools=[WEATHER, TIME], tool_choice="none",
                                         temperature=0, max_tokens=12)
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content
    alone = smol.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER, TIME], tool_choice="none",
                                         max_tokens=1)
    assert final.usage.prompt_tokens > alone.usage.prompt_tokens + 20  # the call and its result are in the prompt


def test_streamed_tool_call_deltas_add_up_to_the_call(smol):
    kwargs = dict(model="smol", messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                  temperature=0, max_tokens=60)
    whole = smol.chat.completions.create(**kwargs).choices[0].message
    chunks = [c for c in smol.chat.completions.create(stream=True, **kwargs) if c.choices]
    pieces = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices[0].delta.tool_calls]
    first, rest = pieces[0], pieces[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather" and first.function.arguments == ""
    assert len(rest) > 1 and all(p.id is None and p.function.name is None for p in rest)  # arguments in pieces
    assert "".join(p.function.arguments for p in rest) == whole.tool_calls[0].function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    assert not any(c.choices[0].delta.content for c in chunks)


def test_named_tool_choice_calls_that_function(smol):
    out = smol.chat.completions.create(model="smol", messages=ASK, tools=[TIME, WEATHER], temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       max_tokens=40)
    name, arguments = call_of(out.choices[0].message)
    assert name == "get_weather" and out.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(arguments, WEATHER_SCHEMA)


def test_a_minimal_agent_loop_calls_a_python_function(smol):
    """The loop a user writes with the openai client: call, run the tool, hand back its result, answer."""
    calls = []

    def get_weather(city: str, unit: str) -> dict:
        calls.append((city, unit))
        return {"city": city, "temperature": 18 if unit == "celsius" else 64, "unit": unit}

    functions = {"get_weather": get_weather}
    messages = list(ASK)
    for turn in range(3):
        out = smol.chat.completions.create(model="smol", messages=messages, tools=[WEATHER], temperature=0,
                                           tool_choice="required" if turn == 0 else "none", max_tokens=40,
                                           parallel_tool_calls=False)
        message = out.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            result = functions[call.function.name](**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    assert len(calls) == 1 and calls[0][1] in ("celsius", "fahrenheit")
    assert messages[-1]["role"] == "assistant" and messages[-1]["content"]


def test_native_template_gets_the_tools_and_the_history(tiny):
    plain = tiny.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, temperature=0)
    with_tools = tiny.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=4,
                                              temperature=0, tool_choice="auto")
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the template wrote the tools in
    # A random model held to the grammar. (Its byte-level tokens can spell invalid UTF-8 inside a string, which
    # xgrammar counts differently from Python, so the schema here has no string lengths.)
    unit = {"type": "function", "function": {"name": "set_unit", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "hourly": {"type": "boolean"}},
        "required": ["unit", "hourly"], "additionalProperties": False}}}
    out = tiny.chat.completions.create(model="tiny", messages=ASK, tools=[unit, WEATHER], tool_choice="required",
                                       temperature=0, max_tokens=200, parallel_tool_calls=False)
    name, arguments = call_of(out.choices[0].message)
    if name == "set_unit":
        jsonschema.validate(arguments, unit["function"]["parameters"])
    else:
        assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    history = ASK + [out.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": out.choices[0].message.tool_calls[0].id, "content": "18 C"}]
    again = tiny.chat.completions.create(model="tiny", messages=history, tools=[unit, WEATHER], max_tokens=4)
    assert again.usage.prompt_tokens > with_tools.usage.prompt_tokens


def test_a_required_call_follows_schemas_with_references(tiny):
    """Schemas that refer to their own $defs (as pydantic writes them) or to themselves ("#"): with tool_choice
    "required" each call is held to its function's schema, references included (they were resolved from the
    array of calls around them, and refused)."""
    unit = {"type": "function", "function": {"name": "set_unit", "parameters": {
        "$defs": {"Unit": {"enum": ["celsius", "fahrenheit"], "type": "string"}},
        "type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}, "hourly": {"type": "boolean"}},
        "required": ["unit", "hourly"], "additionalProperties": False}}}
    tree = {"type": "function", "function": {"name": "nest", "parameters": {
        "type": "object", "properties": {"leaf": {"type": "boolean"}, "child": {"$ref": "#"}}, "required": ["leaf"],
        "additionalProperties": False}}}
    for tools in ([unit], [unit, tree]):
        out = tiny.chat.completions.create(model="tiny", messages=ASK, tools=tools, tool_choice="required",
                                           temperature=0, max_tokens=300, parallel_tool_calls=False)
        name, arguments = call_of(out.choices[0].message)
        jsonschema.validate(arguments, {"unit": unit, "tree": tree}["unit" if name == "set_unit" else "tree"]
                            ["function"]["parameters"])


def test_a_required_call_cut_short_is_a_call_streamed_or_not(tiny):
    """max_tokens ends a required call inside its arguments: the answer is that call with the arguments written so
    far and finish_reason "length", as OpenAI returns it, streamed or not (before, the whole answer was the
    grammar's array as text, and only the stream had the call)."""
    kwargs = dict(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                  temperature=0, max_tokens=40)
    out = tiny.chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    written = call.function.arguments  # properties come in the schema's order: the city first
    assert call.function.name == "get_weather" and (written.startswith('{"city": "') or '{"city": "'.startswith(written))
    streamed = {"name": "", "arguments": ""}
    for chunk in tiny.chat.completions.create(**kwargs, stream=True):
        for piece in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            streamed["name"] += piece.function.name or ""
            streamed["arguments"] += piece.function.arguments or ""
    assert streamed == {"name": "get_weather", "arguments": call.function.arguments}


def test_tokenize_counts_a_tool_conversation_as_chat_sends_it(tiny, qwen_server):
    """/tokenize with messages and tools gives the prompt chat completions use: the tools written in, a call in
    the history and its result as the template writes them (before, tools were ignored and calls left empty)."""
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    chat = tiny.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=1)
    r = httpx.post(f"{qwen_server.url}/tokenize", json={"model": "tiny", "messages": history, "tools": [WEATHER]})
    assert r.status_code == 200 and r.json()["count"] == chat.usage.prompt_tokens
    without = httpx.post(f"{qwen_server.url}/tokenize", json={"model": "tiny", "messages": history}).json()["count"]
    assert without < chat.usage.prompt_tokens


def _tools_with(**function) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", **function}}]


BAD = [
    ({"tools": _tools_with(parameters={"type": "object", "properties": {"x": {"type": "nonsense"}}})},
     "tools[0].function.parameters"),
    ({"tools": _tools_with(parameters={"type": "string"})}, "tools[0].function.parameters"),
    ({"tools": _tools_with() + _tools_with()}, "tools[1].function.name"),
    ({"tools": _tools_with(), "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": _tools_with(), "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": _tools_with(), "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": ASK + [{"role": "tool", "tool_call_id": "call_nobody", "content": "1"}]},
     "messages[1].tool_call_id"),
    ({"messages": ASK + [{"role": "tool", "content": "1"}]}, "messages[1].tool_call_id"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
]


@pytest.mark.parametrize("payload, param", BAD, ids=[p for _, p in BAD])
def test_bad_tool_inputs_are_400_with_param(qwen_server, payload, param):
    body = {"model": "tiny", "messages": ASK, "max_tokens": 2, **payload}
    response = httpx.post(f"{qwen_server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_a_moved_schema_keeps_its_data_and_its_names():
    """Only "#" and "#/..." references move; values of const, enum, default and examples are data, a property
    may be called "enum", an anchor reference stays, and an $id goes (references would resolve against it)."""
    from backend.server.tools.tool_defs import _moved_refs

    schema = {"$id": "urn:x", "properties": {"enum": {"$ref": "#/$defs/A"}, "c": {"const": {"$ref": "#/kept"}}},
              "$defs": {"A": {"$ref": "#"}}, "x": {"$ref": "#anchor"}, "enum": [{"$ref": "#/data"}]}
    assert _moved_refs(schema, "#/$defs/tool0") == {
        "properties": {"enum": {"$ref": "#/$defs/tool0/$defs/A"}, "c": {"const": {"$ref": "#/kept"}}},
        "$defs": {"A": {"$ref": "#/$defs/tool0"}}, "x": {"$ref": "#anchor"}, "enum": [{"$ref": "#/data"}]}
