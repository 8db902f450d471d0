"""/v1/responses with every tool type Codex sends: namespace tools (offered by qualified name, calls returned with
their namespace), custom (free-form) tools, hosted tools left out of the prompt, and Codex's other request
fields; through the official openai client against real servers."""

import json

import jsonschema
import openai
import pytest

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                  "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": WEATHER_SCHEMA}
NAMESPACE = {"type": "namespace", "name": "mcp__weather__", "description": "A weather service",
             "tools": [WEATHER]}
PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch to the files",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}
HOSTED = [{"type": "web_search", "external_web_access": False}, {"type": "file_search", "vector_store_ids": ["v"]},
          {"type": "code_interpreter", "container": {"type": "auto"}}, {"type": "image_generation"},
          {"type": "computer_use_preview", "display_width": 1, "display_height": 1, "environment": "linux"}]
ASK = "What is the weather like in Paris today?"
CODEX_FIELDS = {"reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"], "store": False,
                "prompt_cache_key": "01a23b30", "client_metadata": {"x-codex-turn-metadata": "{}"},
                "text": {"verbosity": "low"}, "parallel_tool_calls": True, "tool_choice": "auto"}


def prompt_tokens(client, tools, input_items=ASK) -> int:
    return client.responses.create(model="tiny", input=input_items, tools=tools, max_output_tokens=1,
                                   temperature=0).usage.input_tokens


def test_hosted_tools_are_left_out_and_codex_fields_accepted(tiny):
    assert prompt_tokens(tiny, [WEATHER, *HOSTED]) == prompt_tokens(tiny, [WEATHER])
    only_hosted = tiny.responses.create(model="tiny", input=ASK, tools=HOSTED, max_output_tokens=2, temperature=0,
                                        extra_body=CODEX_FIELDS)
    assert only_hosted.status in ("completed", "incomplete")
    assert only_hosted.usage.input_tokens == prompt_tokens(tiny, None)


def test_namespace_and_custom_tools_are_offered_by_qualified_name(tiny):
    qualified = {**WEATHER, "name": "mcp__weather__get_weather"}
    assert prompt_tokens(tiny, [NAMESPACE]) == prompt_tokens(tiny, [qualified])
    other = {**NAMESPACE, "name": "agents", "tools": [{**WEATHER, "name": "spawn"}]}
    assert prompt_tokens(tiny, [NAMESPACE, other]) == prompt_tokens(
        tiny, [qualified, {**WEATHER, "name": "agents__spawn"}])
    assert prompt_tokens(tiny, [NAMESPACE, PATCH]) > prompt_tokens(tiny, [NAMESPACE]) + 10


def test_namespaced_call_comes_back_with_its_namespace(smol):
    kwargs = dict(model="smol", input=ASK, tools=[NAMESPACE, HOSTED[0]], temperature=0, max_output_tokens=60,
                  tool_choice={"type": "function", "name": "get_weather", "namespace": "mcp__weather__"},
                  extra_body={k: v for k, v in CODEX_FIELDS.items() if k != "tool_choice"})
    out = smol.responses.create(**kwargs)
    (call,) = [item.model_dump() for item in out.output if item.type == "function_call"]
    assert call["name"] == "get_weather" and call["namespace"] == "mcp__weather__"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER_SCHEMA)
    events = list(smol.responses.create(stream=True, **kwargs))
    added = [e.item.model_dump() for e in events if e.type == "response.output_item.added"]
    assert [(a["name"], a["namespace"]) for a in added] == [("get_weather", "mcp__weather__")]
    done = events[-1].response.output[0].model_dump()
    assert done["namespace"] == "mcp__weather__" and done["arguments"] == call["arguments"]

    history = [{"role": "user", "content": ASK},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather", "namespace": "mcp__weather__",
                "arguments": call["arguments"]},
               {"type": "function_call_output", "call_id": "call_1", "output": "18 degrees"}]
    follow = smol.responses.create(model="smol", input=history, tools=[NAMESPACE], max_output_tokens=5,
                                   temperature=0)
    flat = [*history[:1], {**history[1], "name": "mcp__weather__get_weather"}, history[2]]
    flat[1].pop("namespace")
    same = smol.responses.create(model="smol", input=flat, tools=[{**WEATHER, "name": "mcp__weather__get_weather"}],
                                 max_output_tokens=5, temperature=0)
    assert follow.usage.input_tokens == same.usage.input_tokens


def test_custom_tool_call_is_a_custom_tool_call_item(smol):
    kwargs = dict(model="smol", input="Make a patch that adds a README file.", tools=[PATCH], temperature=0,
                  max_output_tokens=80, tool_choice={"type": "custom", "name": "apply_patch"})
    out = smol.responses.create(**kwargs)
    (call,) = [item for item in out.output if item.type == "custom_tool_call"]
    assert call.name == "apply_patch" and isinstance(call.input, str) and call.call_id.startswith("call_")
    events = list(smol.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert "response.custom_tool_call_input.done" in kinds and "response.function_call_arguments.delta" not in kinds
    # the item is added with no input; the deltas carry it, once (a client appending them to the item has it whole)
    [added] = [e.item for e in events if e.type == "response.output_item.added"]
    deltas = "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta")
    assert added.input == "" and added.input + deltas == call.input
    done = next(e for e in events if e.type == "response.custom_tool_call_input.done")
    assert done.input == call.input and events[-1].response.output[0].input == call.input

    history = [{"role": "user", "content": "Make a patch."},
               {"type": "custom_tool_call", "call_id": "call_9", "name": "apply_patch", "input": call.input},
               {"type": "custom_tool_call_output", "call_id": "call_9", "output": "Done"}]
    follow = smol.responses.create(model="smol", input=history, tools=[PATCH], max_output_tokens=5, temperature=0)
    bare = smol.responses.create(model="smol", input=history[:1], tools=[PATCH], max_output_tokens=5, temperature=0)
    assert follow.usage.input_tokens > bare.usage.input_tokens + 5


def test_a_namespace_holding_something_else_is_refused(tiny):
    with pytest.raises(openai.BadRequestError) as e:
        tiny.responses.create(model="tiny", input=ASK, tools=[{**NAMESPACE, "tools": [HOSTED[0]]}])
    assert "tools[0].tools[0].type" in str(e.value)


def test_a_custom_call_cut_short_keeps_the_input_written_so_far():
    from backend.server.responses_tools import partial_input

    assert partial_input('{"input": "*** Begin Patch\\nab') == "*** Begin Patch\nab"
    assert partial_input('{"input": "caf\\u00e') == "caf"  # a cut escape is left out
    assert partial_input('{"input": "tab\\') == "tab"
    assert partial_input("not the wrapper") == "not the wrapper"
