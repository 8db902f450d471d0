"""The real server in a subprocess, driven by the official openai client and raw httpx."""

import asyncio
import time

import httpx
import openai
import pytest

from backend import LLM, SamplingParams
from tests.backend.server_process import ServerProcess, error_of, metric

QUESTION = [{"role": "user", "content": "The scribe copied the manuscript"}]


@pytest.fixture(scope="module")
def model_dir(tiny_dir):
    return tiny_dir("llama")


@pytest.fixture(scope="module")
def server(model_dir):
    proc = ServerProcess(str(model_dir), "--served-model-name", "tiny", "--max-num-seqs", "64",
                         "--block-size", "8", "--max-model-len", "256")
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), block_size=8, max_model_len=256)





def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert client.models.retrieve("tiny") == models.data[0]  # GET /v1/models/{id}, as the SDKs ask it
    with pytest.raises(openai.NotFoundError, match="this server serves `tiny`"):
        client.models.retrieve("gpt-9")


def test_chat_streamed_equals_non_streamed_and_offline(client, offline):
    full = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=24, temperature=0)
    choice = full.choices[0]
    assert full.object == "chat.completion" and choice.message.role == "assistant"
    expected = offline.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert full.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert full.usage.completion_tokens == len(expected.outputs[0].token_ids)

    stream = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_prompt_forms_and_streaming(client, offline):
    prompt_ids = offline.tokenizer("The apprentice mixed").input_ids
    for prompt in ("The apprentice mixed", prompt_ids, [prompt_ids]):
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        expected = offline.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
        assert out.choices[0].text == expected.outputs[0].text
    two = client.completions.create(model="tiny", prompt=["The apprentice mixed", "Paged attention"], n=2,
                                    max_tokens=6, temperature=0)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert two.choices[0].text == two.choices[1].text  # greedy siblings agree
    streamed = client.completions.create(model="tiny", prompt="The apprentice mixed", max_tokens=12,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text


def test_n_seed_and_stop(client):
    kwargs = dict(model="tiny", messages=QUESTION, max_tokens=16, temperature=1.0, seed=11)
    a = client.chat.completions.create(n=3, **kwargs)
    b = client.chat.completions.create(n=3, **kwargs)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1
    greedy = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=24, temperature=0)
    text = greedy.choices[0].message.content
    stop = text[8:11]
    stopped = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=24, temperature=0, stop=stop)
    assert stopped.choices[0].message.content == text[:text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=24, temperature=0,
                                              stop=[stop], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text[:text.index(stop)]


def test_logprobs(client, offline):
    out = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=5, temperature=0, logprobs=True,
                                         top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    expected = offline.chat(QUESTION, SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[0]
    for item, (token, entry) in zip(content, zip(expected.outputs[0].token_ids, expected.outputs[0].logprobs)):
        assert item.logprob == pytest.approx(entry[token].logprob, abs=1e-4)
        assert len(item.top_logprobs) == 3 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob


def test_64_concurrent_streams_match_the_offline_engine(server, offline):
    conversations = [[{"role": "user", "content": f"Copy line {i} of the manuscript, scribe number {i * 7}"}]
                     for i in range(64)]
    expected = offline.chat(conversations, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)

    async def one(client, messages):
        stream = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0,
                                                      stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        async with client:
            return await asyncio.gather(*(one(client, m) for m in conversations))

    texts = asyncio.run(main())
    assert texts == [e.outputs[0].text for e in expected]





@pytest.mark.parametrize("payload,param", [
    ({"temperature": -1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"presence_penalty": 9}, "presence_penalty"),
    ({"top_k": -5}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"n": "three"}, "n"),
    ({"stop": [""]}, "stop"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_invalid_parameters_are_400_with_param(server, payload, param):
    body = {"model": "tiny", "messages": QUESTION, **payload}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_other_errors(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "gpt-9", "messages": QUESTION})
    assert r.status_code == 404 and error_of(r)["code"] == "model_not_found"
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": [7] * 300})
    assert r.status_code == 400 and error_of(r)["param"] == "prompt"
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": [100000]})
    assert r.status_code == 400 and "token ids must be integers in" in error_of(r)["message"]
    r = httpx.post(f"{server.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in error_of(r)["message"]
    r = httpx.get(f"{server.url}/v1/nothing-here")
    assert r.status_code == 404 and error_of(r)["type"] == "not_found_error"


def test_garbage_never_causes_a_500(server):
    payloads = [None, [], "text", 5, {"prompt": None}, {"prompt": {"a": 1}}, {"prompt": [[]]}, {"prompt": [-1]},
                {"prompt": "x", "logprobs": 99}, {"prompt": "x", "stop": 5}, {"prompt": "x", "seed": "s"},
                {"prompt": "x", "min_tokens": 3}, {"prompt": "x", "max_tokens": 0}, {"prompt": "x", "best_of": 3}, {"prompt": "x", "stop_token_ids": [-4]},
                {"prompt": "x", "max_tokens": -3}, {"prompt": "x", "temperature": "hot"}]
    for payload in payloads:
        r = httpx.post(f"{server.url}/v1/completions", json=payload)
        assert 400 <= r.status_code < 500, (payload, r.text)
        error_of(r)


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    aborted_before = metric(server, "scriptorium_requests_total", outcome="abort")
    with httpx.stream("POST", f"{server.url}/v1/completions", json={
        "model": "tiny", "prompt": "The scribe", "max_tokens": 200, "temperature": 0.8, "ignore_eos": True,
        "stream": True,
    }) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if metric(server, "scriptorium_requests_total", outcome="abort") > aborted_before:
            break
        time.sleep(0.1)
    assert metric(server, "scriptorium_requests_total", outcome="abort") == aborted_before + 1
    assert metric(server, "scriptorium_requests_running") == 0
    assert metric(server, "scriptorium_kv_cache_usage_ratio") == 0


def test_sleep_and_wake_round_trip(server, client):
    before = client.completions.create(model="tiny", prompt="The scribe", max_tokens=8, temperature=0).choices[0].text
    r = httpx.post(f"{server.url}/sleep", params={"level": 1})
    assert r.status_code == 200 and r.json()["is_sleeping"] is True
    assert httpx.get(f"{server.url}/is_sleeping").json() == {"is_sleeping": True}
    assert metric(server, "scriptorium_sleeping") == 1
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 503 and r.headers["retry-after"] and error_of(r)["type"] == "service_unavailable"
    assert httpx.get(f"{server.url}/health").json() == {"status": "sleeping"}
    assert httpx.post(f"{server.url}/wake_up").json() == {"is_sleeping": False}
    after = client.completions.create(model="tiny", prompt="The scribe", max_tokens=8, temperature=0).choices[0].text
    assert after == before
    assert httpx.post(f"{server.url}/sleep", params={"level": 2}).status_code == 200
    assert httpx.post(f"{server.url}/wake_up").status_code == 200  # weights read from disk again
    again = client.completions.create(model="tiny", prompt="The scribe", max_tokens=8, temperature=0).choices[0].text
    assert again == before
    assert httpx.post(f"{server.url}/sleep", params={"level": 3}).status_code == 400


def test_response_format_json_schema(client, server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "tags": {"type": "array", "maxItems": 3,
                                                        "items": {"type": "string", "maxLength": 10}}},
              "required": ["name", "tags"], "additionalProperties": False}
    out = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=200, temperature=0.7, seed=2,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "card", "schema": schema}})
    import json

    import jsonschema

    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    streamed = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=200, temperature=0,
                                              response_format={"type": "json_object"}, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text[:1] in "{["
    for fmt in ({"type": "yaml"}, {"type": "json_schema", "json_schema": {"name": "x"}},
                {"type": "json_schema", "json_schema": {"schema": {"type": "object", "$ref": "#/missing"}}}):
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": QUESTION, "response_format": fmt})
        assert r.status_code == 400 and error_of(r)["param"] == "response_format", r.text
