"""What agent clients send, answered alike on every API: a max_tokens past the context (clamped, or refused where
the server is told to), the prompt's cached tokens in each API's usage, and Claude Code's per-request billing line
kept out of the prompt so the rest of it is cached across requests. The official SDKs read the answers."""

import re

import anthropic
import httpx
import openai
import pytest

from tests.backend.server_process import ServerProcess, error_of

CONTEXT = 256
ASK = [{"role": "user", "content": "The scribe copied the manuscript"}]
# A system prompt long enough to fill several KV blocks (block size 8), the same in every request below.
SYSTEM = "You are the scriptorium's copyist. " * 4


def billing(suffix: str) -> str:
    return f"x-anthropic-billing-header: cc_version=2.1.197.{suffix}; cc_entrypoint=sdk-cli;"


@pytest.fixture(scope="module")
def clamping(tiny_dir):
    proc = ServerProcess(str(tiny_dir("llama")), "--served-model-name", "tiny", "--block-size", "8",
                         "--max-model-len", str(CONTEXT))
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def refusing(tiny_dir):
    proc = ServerProcess(str(tiny_dir("llama")), "--served-model-name", "tiny", "--block-size", "8",
                         "--max-model-len", str(CONTEXT), "--max-tokens-past-context", "refuse",
                         "--keep-attribution-header")
    yield proc
    assert proc.stop() == 0


def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_max_tokens_past_the_context_is_clamped_alike_on_every_api(clamping):
    client = oai(clamping)
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=ASK, max_tokens=32000,
                                                           temperature=0, extra_body={"ignore_eos": True})
    chat = raw.parse()
    granted = CONTEXT - chat.usage.prompt_tokens
    assert int(raw.headers["x-max-tokens-clamped"]) == granted
    assert chat.usage.completion_tokens == granted and chat.choices[0].finish_reason == "length"

    raw = client.completions.with_raw_response.create(model="tiny", prompt="The scribe", max_tokens=65536)
    done = raw.parse()
    assert int(raw.headers["x-max-tokens-clamped"]) == CONTEXT - done.usage.prompt_tokens

    raw = client.responses.with_raw_response.create(model="tiny", input="The scribe copied", max_output_tokens=32000)
    response = raw.parse()
    assert int(raw.headers["x-max-tokens-clamped"]) == CONTEXT - response.usage.input_tokens

    raw = claude(clamping).messages.with_raw_response.create(model="tiny", messages=ASK, max_tokens=8192)
    message = raw.parse()
    prompt_tokens = message.usage.input_tokens + message.usage.cache_read_input_tokens  # Anthropic counts them apart
    assert int(raw.headers["x-max-tokens-clamped"]) == CONTEXT - prompt_tokens

    with client.chat.completions.with_streaming_response.create(model="tiny", messages=ASK, max_tokens=32000,
                                                                stream=True) as streamed:
        assert int(streamed.headers["x-max-tokens-clamped"]) == granted
        assert any(chunk.choices and chunk.choices[0].finish_reason for chunk in streamed.parse())

    within = client.chat.completions.with_raw_response.create(model="tiny", messages=ASK, max_tokens=4)
    assert "x-max-tokens-clamped" not in within.headers and within.parse().usage.completion_tokens <= 4


def test_the_refuse_policy_answers_every_api_with_vllms_400(refusing):
    for path, body in [("/v1/chat/completions", {"messages": ASK, "max_tokens": 32000}),
                       ("/v1/completions", {"prompt": "The scribe", "max_tokens": 300}),
                       ("/v1/responses", {"input": "The scribe", "max_output_tokens": 32000})]:
        r = httpx.post(f"{refusing.url}{path}", json={"model": "tiny", **body})
        assert r.status_code == 400, (path, r.text)
        error = error_of(r)
        assert error["code"] == "context_length_exceeded", path
        assert f"maximum context length is {CONTEXT} tokens. However, you requested" in error["message"]
    # vLLM's wording, with the numbers agent clients read to retry within the context (Hermes Agent does)
    error = error_of(httpx.post(f"{refusing.url}/v1/completions",
                                json={"model": "tiny", "prompt": "hi", "max_tokens": 300}))
    assert error["param"] == "max_tokens"
    found = re.search(r"maximum context length is 256 tokens\. However, you requested 300 output tokens and your "
                      r"prompt contains at least (\d+) input tokens, for a total of at least (\d+) tokens",
                      error["message"])
    assert found and int(found[2]) == int(found[1]) + 300
    assert f"max_tokens: at most {256 - int(found[1])} here" in error["message"]
    with pytest.raises(anthropic.BadRequestError, match="However, you requested 8192 output tokens"):
        claude(refusing).messages.create(model="tiny", messages=ASK, max_tokens=8192)


def test_cached_prompt_tokens_are_reported_on_every_api(clamping):
    client = oai(clamping)
    messages = [{"role": "system", "content": SYSTEM}, *ASK]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens_details.cached_tokens
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= again.usage.prompt_tokens - 8 and cached % 8 == 0  # every full block of the prompt

    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached

    prompt = SYSTEM + "The scribe"
    client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    cached = client.completions.create(model="tiny", prompt=prompt, max_tokens=1).usage.prompt_tokens_details.\
        cached_tokens
    assert cached > 0
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=1, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached

    client.responses.create(model="tiny", instructions=SYSTEM, input="The scribe", max_output_tokens=2)
    again = client.responses.create(model="tiny", instructions=SYSTEM, input="The scribe", max_output_tokens=2)
    assert again.usage.input_tokens_details.cached_tokens > 0
    with client.responses.create(model="tiny", instructions=SYSTEM, input="The scribe", max_output_tokens=2,
                                 stream=True) as events:
        last = list(events)[-1]  # response.incomplete: max_output_tokens cut it
    assert last.response.usage.input_tokens_details.cached_tokens == again.usage.input_tokens_details.cached_tokens


def test_message_start_reports_the_cache_read(clamping):
    client = claude(clamping)
    client.messages.create(model="tiny", system=SYSTEM, messages=ASK, max_tokens=2)
    with client.messages.create(model="tiny", system=SYSTEM, messages=ASK, max_tokens=2, stream=True) as events:
        events = list(events)
    start, delta = events[0], next(e for e in events if e.type == "message_delta")
    assert start.type == "message_start"
    assert start.message.usage.cache_read_input_tokens == delta.usage.cache_read_input_tokens > 0
    whole = start.message.usage.input_tokens + start.message.usage.cache_read_input_tokens
    assert whole == client.messages.count_tokens(model="tiny", system=SYSTEM, messages=ASK).input_tokens


def system_blocks(suffix: str) -> list[dict]:
    return [{"type": "text", "text": billing(suffix)}, {"type": "text", "text": SYSTEM}]


def test_claude_codes_billing_line_is_left_out_so_the_prompt_is_cached(clamping):
    client = claude(clamping)
    plain = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=ASK).input_tokens
    # the line alone in a block, or as the first line of the text: neither reaches the model
    assert client.messages.count_tokens(model="tiny", system=system_blocks("a1f"), messages=ASK).input_tokens == plain
    inline = billing("b2e") + "\n" + SYSTEM
    assert client.messages.count_tokens(model="tiny", system=inline, messages=ASK).input_tokens == plain

    system_tokens = plain - client.messages.count_tokens(model="tiny", system="x", messages=ASK).input_tokens
    client.messages.create(model="tiny", system=system_blocks("c3d"), messages=ASK, max_tokens=1)
    other = [{"role": "user", "content": "Another question altogether, about ink"}]
    second = client.messages.create(model="tiny", system=system_blocks("d4c"), messages=other, max_tokens=1)
    assert system_tokens > 40 and second.usage.cache_read_input_tokens >= system_tokens - 8  # its full blocks


def test_keep_attribution_header_keeps_the_line(refusing):
    client = claude(refusing)
    plain = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=ASK).input_tokens
    assert client.messages.count_tokens(model="tiny", system=system_blocks("e5b"), messages=ASK).input_tokens > plain


def near_the_end(client: anthropic.Anthropic, left: int) -> list[dict]:
    """A conversation whose prompt leaves at most `left` tokens of the context (and not many fewer)."""
    def asking(words: int) -> list[dict]:
        return [{"role": "user", "content": "Copy on. " + "ink " * words}]

    low, high = 0, CONTEXT
    while low < high:  # the most words that still leave `left`
        mid = (low + high + 1) // 2
        fits = client.messages.count_tokens(model="tiny", messages=asking(mid)).input_tokens <= CONTEXT - left
        low, high = (mid, high) if fits else (low, mid - 1)
    return asking(low)


def test_an_answer_the_context_ends_says_so(clamping):
    client = claude(clamping)
    messages = near_the_end(client, 6)
    prompt_tokens = client.messages.count_tokens(model="tiny", messages=messages).input_tokens
    room = CONTEXT - prompt_tokens
    assert 2 < room <= 8

    greedy = {"extra_body": {"temperature": 0}}  # this SDK has no temperature argument; the API has the field
    ended = client.messages.create(model="tiny", messages=messages, max_tokens=8192, **greedy)
    assert ended.usage.output_tokens == room  # the whole rest of the context: the context ended it
    assert ended.stop_reason == "model_context_window_exceeded"
    with client.messages.stream(model="tiny", messages=messages, max_tokens=8192, **greedy) as stream:
        assert stream.get_final_message().stop_reason == "model_context_window_exceeded"
    for max_tokens in (room - 1, room):  # the client's own limit, even where it is all the context leaves
        cut = client.messages.create(model="tiny", messages=messages, max_tokens=max_tokens, **greedy)
        assert cut.usage.output_tokens == max_tokens and cut.stop_reason == "max_tokens"
        with client.messages.stream(model="tiny", messages=messages, max_tokens=max_tokens, **greedy) as s:
            assert s.get_final_message().stop_reason == "max_tokens"

    # OpenAI's APIs have no reason of their own for it: "length" and max_output_tokens, as OpenAI answers
    chat = oai(clamping).chat.completions.create(model="tiny", messages=messages, max_tokens=32000, temperature=0)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == room
    response = oai(clamping).responses.create(model="tiny", input=messages, max_output_tokens=32000, temperature=0)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
