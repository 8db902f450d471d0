"""/v1/messages (Anthropic's Messages API) through the official anthropic SDK, against real servers: answers as
the chat path gives them, streamed events in the documented order, tool_use and tool_result, count_tokens, and
errors in Anthropic's shape."""

import asyncio
import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from backend.server.messages_stream import with_pings
from tests.backend.server_process import ServerProcess
from tests.backend.tiny_models import TOOLS_CHAT_TEMPLATE, build_model

WEATHER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}
WEATHER = {"name": "get_weather", "description": "The current weather in a city", "input_schema": WEATHER_SCHEMA}
ASK = "What is the weather like in Paris today?"
GREEDY = {"temperature": 0}  # the SDK's create() no longer takes temperature; the API still does


@pytest.fixture(scope="module")
def smol(smol_server):
    return anthropic.Anthropic(base_url=smol_server.url, api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def tiny(qwen_server):
    return anthropic.Anthropic(base_url=qwen_server.url, api_key="unused", max_retries=0)


def test_text_matches_chat_completions_and_streams_documented_events(smol, smol_server):
    out = smol.messages.create(model="smol", max_tokens=12, system="Be brief.", extra_body=GREEDY,
                               messages=[{"role": "user", "content": "What is the capital of France?"}])
    chat = openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key="x", max_retries=0).chat.completions.create(
        model="smol", max_tokens=12, temperature=0, messages=[
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}])
    assert out.type == "message" and out.role == "assistant" and out.model == "smol" and out.id.startswith("msg_")
    (block,) = out.content
    assert block.type == "text" and block.text == chat.choices[0].message.content and "Paris" in block.text
    assert out.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    usage = out.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens

    with smol.messages.stream(model="smol", max_tokens=12, system="Be brief.", extra_body=GREEDY,
                              messages=[{"role": "user", "content": "What is the capital of France?"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type in ("message_start", "content_block_start", "content_block_delta",
                                                  "content_block_stop", "message_delta", "message_stop")]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == block.text
    assert final.content[0].text == block.text and final.stop_reason == out.stop_reason
    assert final.usage.output_tokens == usage.output_tokens


def test_stop_sequence_is_reported(smol):
    out = smol.messages.create(model="smol", max_tokens=30, stop_sequences=["Paris"], extra_body=GREEDY,
                               messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == "Paris"
    assert "Paris" not in out.content[0].text


def test_forced_tool_use_validates_streams_and_round_trips(smol):
    kwargs = dict(model="smol", max_tokens=60, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
                  messages=[{"role": "user", "content": ASK}], extra_body=GREEDY)
    out = smol.messages.create(**kwargs)
    assert out.stop_reason == "tool_use"
    (call,) = [b for b in out.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER_SCHEMA)

    with smol.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["tool_use"] and starts[0].name == "get_weather" and starts[0].input == {}
    parts = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert len(parts) > 1 and json.loads("".join(parts)) == call.input
    assert final.stop_reason == "tool_use" and final.content[0].input == call.input

    history = [{"role": "user", "content": ASK},
               {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name,
                                                  "input": call.input}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": [{"type": "text", "text": "18 degrees and sunny"}]}]}]
    follow = smol.messages.create(model="smol", max_tokens=30, tools=[WEATHER], messages=history, extra_body=GREEDY)
    assert follow.stop_reason in ("end_turn", "max_tokens") and follow.content[0].type == "text"
    counted = smol.messages.count_tokens(model="smol", tools=[WEATHER], messages=history)
    assert counted.input_tokens == follow.usage.input_tokens + follow.usage.cache_read_input_tokens
    bare = smol.messages.count_tokens(model="smol", tools=[WEATHER], messages=history[:1])
    assert counted.input_tokens > bare.input_tokens + 20  # the call and its result are in the prompt
    failed = [*history[:2], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                          "content": "no such city", "is_error": True}]}]
    assert smol.messages.count_tokens(model="smol", tools=[WEATHER], messages=failed).input_tokens > \
        bare.input_tokens


def test_any_tool_with_parallel_calls_off_makes_one_call(smol):
    out = smol.messages.create(model="smol", max_tokens=80, tools=[WEATHER], extra_body=GREEDY,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True},
                               messages=[{"role": "user", "content": ASK}])
    (call,) = [b for b in out.content if b.type == "tool_use"]
    assert out.stop_reason == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER_SCHEMA)


def test_system_blocks_mid_conversation_system_and_thinking_blocks_are_read(tiny):
    plain = tiny.messages.count_tokens(model="tiny", system="Be brief.",
                                       messages=[{"role": "user", "content": "one\n\ntwo"}])
    blocks = tiny.messages.count_tokens(
        model="tiny", system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "one"}]},
                  {"role": "user", "content": "two"}])
    assert blocks.input_tokens == plain.input_tokens  # one user turn, as templates that alternate need
    with_system = tiny.messages.count_tokens(
        model="tiny", system="Be brief.",
        messages=[{"role": "user", "content": "one"}, {"role": "system", "content": "two"}])
    assert with_system.input_tokens == plain.input_tokens
    thinking = tiny.messages.count_tokens(model="tiny", messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "x"},
                                          {"type": "text", "text": "hello"}]},
        {"role": "user", "content": "bye"}])
    without = tiny.messages.count_tokens(model="tiny", messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}])
    assert thinking.input_tokens == without.input_tokens


def _error(server, body: dict, path: str = "/v1/messages") -> tuple[int, dict]:
    r = httpx.post(f"{server.url}{path}", json=body, headers={"anthropic-version": "2023-06-01"}, timeout=60)
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    return r.status_code, error["error"]


def test_errors_in_anthropic_shape(qwen_server):
    hi = [{"role": "user", "content": "hi"}]
    status, e = _error(qwen_server, {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]})
    assert status == 400 and e["type"] == "invalid_request_error" and "messages[0].content[0]" in e["message"]
    assert "image" in e["message"]
    status, e = _error(qwen_server, {"model": "nope", "max_tokens": 5, "messages": hi})
    assert status == 404 and e["type"] == "not_found_error" and "--model-alias" in e["message"]
    status, e = _error(qwen_server, {"model": "tiny", "max_tokens": 5, "messages": hi, "bogus": 1})
    assert status == 400 and e["message"] == "bogus: Extra inputs are not permitted"
    status, e = _error(qwen_server, {"model": "tiny", "messages": hi})
    assert status == 400 and e["message"].startswith("max_tokens")
    status, e = _error(qwen_server, {"model": "tiny", "max_tokens": 5, "messages": hi, "temperature": 1.5})
    assert status == 400 and "temperature" in e["message"]
    status, e = _error(qwen_server, {"model": "tiny", "max_tokens": 5, "messages": hi,
                                     "tools": [{"name": "f", "input_schema": {"type": "string"}}]})
    assert status == 400 and "tools[0].input_schema" in e["message"]
    status, e = _error(qwen_server, {"model": "tiny", "max_tokens": 5, "messages": hi,
                                     "tool_choice": {"type": "tool", "name": "f"},
                                     "tools": [{"name": "g", "input_schema": {"type": "object"}}]})
    assert status == 400 and "tool_choice" in e["message"]
    status, e = _error(qwen_server, {"model": "tiny", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]})
    assert status == 400 and "messages[0]" in e["message"]
    status, e = _error(qwen_server, {"model": "tiny", "max_tokens": 5, "messages": hi,
                                     "mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]})
    assert status == 400 and "mcp_servers" in e["message"]
    status, e = _error(qwen_server, {"model": "tiny", "messages": "hi"}, "/v1/messages/count_tokens")
    assert status == 400


def test_max_tokens_past_the_context_is_cut_to_it(tiny):
    out = tiny.messages.create(model="tiny", max_tokens=20_000, extra_body={**GREEDY, "top_k": 1},
                               messages=[{"role": "user", "content": "hi"}])
    whole = out.usage.input_tokens + out.usage.cache_read_input_tokens + out.usage.output_tokens
    assert out.stop_reason in ("end_turn", "model_context_window_exceeded")  # the context, not max_tokens, ends it
    assert whole == 2048 if out.stop_reason == "model_context_window_exceeded" else whole < 2048


def test_api_key_aliases_and_root(tmp_path_factory):
    model = build_model("qwen2", tmp_path_factory.mktemp("keyed") / "tiny", chat_template=TOOLS_CHAT_TEMPLATE)
    server = ServerProcess(str(model), "--served-model-name", "tiny", "--api-key", "sekrit",
                           "--model-alias", "claude-*=tiny")
    try:
        assert httpx.head(f"{server.url}/").status_code == 200 and httpx.get(f"{server.url}/").status_code == 200
        hi = [{"role": "user", "content": "hi"}]
        for client in (anthropic.Anthropic(base_url=server.url, api_key="sekrit", max_retries=0),
                       anthropic.Anthropic(base_url=server.url, auth_token="sekrit", max_retries=0)):
            out = client.messages.create(model="claude-haiku-4-5", max_tokens=3, messages=hi)
            assert out.model == "tiny" and out.usage.output_tokens <= 3
        with pytest.raises(anthropic.AuthenticationError) as wrong:
            anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0).messages.create(
                model="tiny", max_tokens=3, messages=hi)
        assert wrong.value.body["error"]["type"] == "authentication_error"
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", "messages": hi})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert "Bearer" in r.headers["www-authenticate"]
        assert httpx.get(f"{server.url}/health").status_code == 200  # probes stay open
        ok = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sekrit", max_retries=0)
        assert ok.chat.completions.create(model="claude-x", max_tokens=2, messages=hi).model == "tiny"
        with pytest.raises(openai.NotFoundError):
            ok.chat.completions.create(model="gpt-5", max_tokens=2, messages=hi)
    finally:
        assert server.stop() == 0


def test_pings_while_the_first_item_is_slow():
    async def slow():
        await asyncio.sleep(0.35)
        yield "a"
        yield "b"

    async def run():
        return [item async for item in with_pings(slow(), 0.1)]

    got = asyncio.run(run())
    assert got[-2:] == ["a", "b"] and set(got[:-2]) == {None} and len(got) >= 2


def test_a_final_assistant_message_is_continued(tiny, qwen_server):
    """Anthropic's prefill: a conversation that ends with the assistant's words is answered by what follows them,
    from the prompt the template writes up to those words (as transformers' continue_final_message cuts it), and
    the answer holds only the continuation; chat completions take vLLM's continue_final_message for the same."""
    asked = [{"role": "user", "content": "What is 2 + 2?"}]
    prefill = asked + [{"role": "assistant", "content": "The answer is"}]

    def tokenize(messages, **flags) -> list[int]:
        r = httpx.post(f"{qwen_server.url}/tokenize", json={"model": "tiny", "messages": messages, **flags})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    from transformers import AutoTokenizer

    continued = tokenize(prefill, continue_final_message=True)
    model_dir = qwen_server.proc.args[qwen_server.proc.args.index("--model") + 1]
    hf = AutoTokenizer.from_pretrained(model_dir)
    oracle = hf(hf.apply_chat_template(prefill, continue_final_message=True, tokenize=False), add_special_tokens=False)
    assert continued == oracle.input_ids and len(continued) < len(tokenize(prefill, add_generation_prompt=False))
    out = tiny.messages.create(model="tiny", max_tokens=6, messages=prefill, extra_body=GREEDY)
    assert out.usage.input_tokens + (out.usage.cache_read_input_tokens or 0) == len(continued)
    assert tiny.messages.count_tokens(model="tiny", messages=prefill).input_tokens == len(continued)
    chat = openai.OpenAI(base_url=f"{qwen_server.url}/v1", api_key="x", max_retries=0).chat.completions.create(
        model="tiny", messages=prefill, max_tokens=6, temperature=0, extra_body={"continue_final_message": True})
    assert out.content[0].text == chat.choices[0].message.content and chat.usage.prompt_tokens == len(continued)
    r = httpx.post(f"{qwen_server.url}/v1/chat/completions", json={
        "model": "tiny", "messages": asked, "max_tokens": 2, "continue_final_message": True})
    assert r.status_code == 400 and "assistant message with text" in r.json()["error"]["message"]


@pytest.mark.parametrize("final", ["The answer is", "d", "```json\n", "  padded  "])
@pytest.mark.parametrize("trim", [False, True])
def test_the_final_message_is_opened_where_its_turn_writes_it(final, trim, tmp_path):
    """The cut is after the final turn's own content, though the same text is in an earlier turn or the closing
    marker ("d" of "<|im_end|>"), and though the template trims it (Llama 3's and Gemma's do)."""
    from transformers import AutoTokenizer

    from backend.engine.admission import chat_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(build_model("qwen2", tmp_path / "m"))
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content | trim if " + str(trim) + " else m.content }}" \
               "</{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    messages = [{"role": "user", "content": "Fix this:\n```json\n{} d The answer is  padded  "},
                {"role": "assistant", "content": final}]
    ids = chat_prompt_ids(tokenizer, messages, "m", chat_template=template, continue_final_message=True)
    user = messages[0]["content"].strip() if trim else messages[0]["content"]
    assert tokenizer.decode(ids) == f"<user>{user}</user><assistant>{final.strip() if trim else final}"
