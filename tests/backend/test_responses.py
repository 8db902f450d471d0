"""/v1/responses through the official openai client's client.responses.create, streamed and not."""

import json

import httpx
import jsonschema
import pytest

WEATHER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": WEATHER_SCHEMA}
ASK = "What is the weather like in Paris today?"


def test_text_response_matches_chat_and_streams_typed_events(tiny):
    out = tiny.responses.create(model="tiny", instructions="Be brief.", input=ASK, max_output_tokens=8,
                                temperature=0)
    chat = tiny.chat.completions.create(model="tiny", max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}])
    assert out.object == "response" and out.id.startswith("resp_") and out.model == "tiny"
    assert out.output_text == chat.choices[0].message.content
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    (item,) = out.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert out.usage.input_tokens == chat.usage.prompt_tokens and out.usage.output_tokens == 8

    events = list(tiny.responses.create(model="tiny", instructions="Be brief.", input=ASK, max_output_tokens=8,
                                        temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == out.output_text == events[-1].response.output_text
    assert events[0].response.status == "in_progress" and events[-1].response.usage.output_tokens == 8


def test_input_items_with_a_function_call_round_trip(tiny):
    items = [{"role": "user", "content": [{"type": "input_text", "text": ASK}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": json.dumps({"city": "Paris", "unit": "celsius"})},
             {"type": "function_call_output", "call_id": "call_1", "output": json.dumps({"temperature": 18})}]
    out = tiny.responses.create(model="tiny", input=items, tools=[WEATHER], max_output_tokens=4, temperature=0)
    bare = tiny.responses.create(model="tiny", input=items[:1], tools=[WEATHER], max_output_tokens=4, temperature=0)
    assert out.usage.input_tokens > bare.usage.input_tokens + 20  # the call and its output are in the prompt


def test_function_call_item_required_streamed_and_not(smol):
    kwargs = dict(model="smol", input=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                  temperature=0, max_output_tokens=60)
    out = smol.responses.create(**kwargs)
    assert out.status == "completed"
    (call,) = [item for item in out.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)

    events = list(smol.responses.create(stream=True, **kwargs))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call"] and added[0].item.name == "get_weather"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(deltas) > 1 and "".join(deltas) == done.arguments == call.arguments
    assert events[-1].type == "response.completed" and events[-1].response.output[0].arguments == call.arguments

    follow = smol.responses.create(model="smol", tools=[WEATHER], tool_choice="none", max_output_tokens=10,
                                   temperature=0, input=[
                                       {"role": "user", "content": ASK},
                                       {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                        "arguments": call.arguments},
                                       {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}])
    assert follow.output_text and not [i for i in follow.output if i.type == "function_call"]


BAD = [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"tools": [{"type": "function", "name": "has space"}]}, "tools[0].name"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}]}, "tools[0].tools[0].type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": ASK}, {"type": "function_call_output", "call_id": "x", "output": "1"}]},
     "input[1].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "user", "content": ASK}, {"type": "function_call", "call_id": "c", "name": "f",
                                                    "arguments": "{bad"}]}, "input[1].arguments"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
]


@pytest.mark.parametrize("payload, param", BAD, ids=[p for _, p in BAD])
def test_bad_responses_inputs_are_400_with_param(qwen_server, payload, param):
    body = {"model": "tiny", "input": ASK, "max_output_tokens": 2, **payload}
    response = httpx.post(f"{qwen_server.url}/v1/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_bodies_and_events_validate_against_the_clients_types(qwen_server):
    """The openai client builds its objects without validating; pydantic validation checks every field."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    body = {"model": "tiny", "input": ASK, "max_output_tokens": 6, "temperature": 0, "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"}}
    raw = httpx.post(f"{qwen_server.url}/v1/responses", json=body, timeout=60).json()
    Response.model_validate(raw)
    adapter = TypeAdapter(ResponseStreamEvent)
    for text_body in (body, {**body, "tools": None, "tool_choice": None}):
        with httpx.stream("POST", f"{qwen_server.url}/v1/responses", json={**text_body, "stream": True},
                          timeout=60) as r:
            lines = [line for line in r.iter_lines() if line.startswith(("event: ", "data: "))]
        for name, data in zip(lines[::2], lines[1::2]):
            event = adapter.validate_python(json.loads(data.removeprefix("data: ")))
            assert name == f"event: {event.type}"
