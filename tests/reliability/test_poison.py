"""Bad requests get a 4xx and harm nobody: a table of bad inputs, and poison mixed into healthy streams.

Oracles: OpenAI's error shape and status classes; healthy outputs identical to the same requests run
without the poison; /metrics showing nothing running and every KV block free afterwards.
"""

import asyncio
import json

import httpx
import openai
import pytest

from tests.reliability.soak import settle

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": HI, "max_tokens": 4, **fields}


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "The scribe", "max_tokens": 4, **fields}


# (id, path, body: a dict sent as JSON or raw bytes)
BAD_INPUTS = [
    ("n-zero", CHAT, chat(n=0)),
    ("n-negative", CHAT, chat(n=-1)),
    ("n-over-cap", CHAT, chat(n=17)),
    ("n-string", CHAT, chat(n="two")),
    ("seed-over-uint64", CHAT, chat(seed=2**64)),
    ("seed-under-int64", CHAT, chat(seed=-(2**63) - 1)),
    ("seed-float", CHAT, chat(seed=1.5)),
    ("temperature-negative", CHAT, chat(temperature=-0.1)),
    ("temperature-over-2", CHAT, chat(temperature=2.1)),
    ("temperature-string", CHAT, chat(temperature="hot")),
    ("temperature-nan", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
    ("top-p-zero", CHAT, chat(top_p=0)),
    ("top-p-over-1", CHAT, chat(top_p=1.01)),
    ("top-k-minus-2", CHAT, chat(top_k=-2)),
    ("top-k-over-vocab", CHAT, chat(top_k=513)),
    ("top-k-huge", CHAT, chat(top_k=10**20)),
    ("top-k-float", CHAT, chat(top_k=1.5)),
    ("min-p-negative", CHAT, chat(min_p=-0.1)),
    ("min-p-over-1", CHAT, chat(min_p=1.1)),
    ("presence-over-2", CHAT, chat(presence_penalty=2.5)),
    ("frequency-under-minus-2", CHAT, chat(frequency_penalty=-2.5)),
    ("presence-infinity", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                                b'"presence_penalty": Infinity}'),
    ("repetition-zero", CHAT, chat(repetition_penalty=0)),
    ("repetition-negative", CHAT, chat(repetition_penalty=-1)),
    ("max-tokens-zero", CHAT, chat(max_tokens=0)),
    ("max-tokens-negative", CHAT, chat(max_tokens=-5)),
    ("max-tokens-huge", CHAT, chat(max_tokens=10**20)),
    ("max-tokens-over-context", CHAT, chat(max_tokens=257)),
    ("max-completion-tokens-zero", CHAT, chat(max_completion_tokens=0)),
    ("stop-empty", CHAT, chat(stop="")),
    ("stop-list-with-empty", CHAT, chat(stop=["a", ""])),
    ("stop-ints", CHAT, chat(stop=[1, 2])),
    ("stop-too-many", CHAT, chat(stop=["x"] * 65)),
    ("stop-too-long", CHAT, chat(stop="x" * 1025)),
    ("stop-token-ids-negative", CHAT, chat(stop_token_ids=[-1])),
    ("top-logprobs-21", CHAT, chat(logprobs=True, top_logprobs=21)),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2)),
    ("stream-options-without-stream", CHAT, chat(stream_options={"include_usage": True})),
    ("response-format-xml", CHAT, chat(response_format={"type": "xml"})),
    ("response-format-schema-missing", CHAT, chat(response_format={"type": "json_schema", "json_schema": {}})),
    ("guided-json-not-json", CHAT, chat(guided_json="{not json")),
    ("ignore-eos-not-bool", CHAT, chat(ignore_eos="maybe")),
    ("messages-empty", CHAT, chat(messages=[])),
    ("messages-missing", CHAT, {"model": "tiny"}),
    ("role-unknown", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}])),
    ("content-image-part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}])),
    ("content-lone-surrogate", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}'),
    ("stop-lone-surrogate", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "a"}], '
                                  b'"stop": "\\udfff"}'),
    ("model-unknown", CHAT, chat(model="nope")),
    ("body-not-json", CHAT, b"{this is not json"),
    ("body-array", CHAT, b"[1, 2, 3]"),
    ("body-empty", CHAT, b""),
    ("prompt-over-context", CHAT, chat(messages=[{"role": "user", "content": "ink " * 400}])),
    ("prompt-far-over-context", CHAT, chat(messages=[{"role": "user", "content": "a" * 1_000_000}])),
    ("prompt-empty-list", COMPLETIONS, completion(prompt=[])),
    ("prompt-negative-id", COMPLETIONS, completion(prompt=[-1])),
    ("prompt-id-over-vocab", COMPLETIONS, completion(prompt=[512])),
    ("prompt-id-huge", COMPLETIONS, completion(prompt=[2**70])),
    ("prompt-empty-inner", COMPLETIONS, completion(prompt=[[]])),
    ("prompt-second-bad", COMPLETIONS, completion(prompt=[[3, 4], [1000]])),
    ("prompt-lone-surrogate", COMPLETIONS, b'{"model": "tiny", "prompt": "\\ud83d"}'),
    ("prompt-far-over-context-text", COMPLETIONS, completion(prompt="a" * 1_000_000)),
    ("max-tokens-zero-without-echo", COMPLETIONS, completion(max_tokens=0)),
    ("min-tokens-unsupported", COMPLETIONS, completion(min_tokens=3)),
    ("chat-echo-unsupported", CHAT, chat(echo=True)),
    ("suffix", COMPLETIONS, completion(suffix="x")),
    ("best-of", COMPLETIONS, completion(best_of=2)),
    ("completion-logprobs-21", COMPLETIONS, completion(logprobs=21)),
    ("completion-n-over-cap", COMPLETIONS, completion(n=100)),
    ("completion-top-k-huge", COMPLETIONS, completion(top_k=10**20)),
]


def post(url: str, path: str, body, timeout: float = 60) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"}, timeout=timeout)
    return httpx.post(f"{url}{path}", json=body, timeout=timeout)


def test_the_table_is_long_enough():
    assert len(BAD_INPUTS) >= 40 and len({case[0] for case in BAD_INPUTS}) == len(BAD_INPUTS)


@pytest.mark.parametrize("path,body", [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_gets_a_4xx_in_openai_shape_and_the_server_stays_healthy(poison_server, path, body):
    response = post(poison_server.url, path, body)
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert httpx.get(f"{poison_server.url}/health", timeout=10).status_code == 200
    healthy = post(poison_server.url, CHAT, chat(temperature=0))
    assert healthy.status_code == 200 and healthy.json()["choices"][0]["finish_reason"] in ("stop", "length")


# Requests that used to break the engine for everyone and are valid: they must simply work.
FORMERLY_POISON = {
    "n2-seed-uint64-max": chat(n=2, seed=2**64 - 1, temperature=1.0, max_tokens=6),
    "json-object-ignore-eos": chat(response_format={"type": "json_object"}, ignore_eos=True, max_tokens=40),
    "temperature-1e-300": chat(temperature=1e-300, max_tokens=12, ignore_eos=True),
    "top-k-vocab": chat(top_k=512, temperature=1.0, seed=3),
}
REFUSED_POISON = ["top-k-huge", "seed-over-uint64", "n-over-cap", "temperature-nan", "content-lone-surrogate",
                  "prompt-far-over-context", "prompt-second-bad", "stop-too-many", "completion-top-k-huge"]


async def _healthy_streams(url: str) -> list[str]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(i: int) -> str:
        sampled = i % 2  # half greedy, half seeded sampling: both must be exactly reproducible
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"page {i} of the manuscript"}], max_tokens=24,
            temperature=0.9 if sampled else 0, seed=100 + i if sampled else None, stream=True,
            extra_body={"ignore_eos": True})
        text = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
        return "".join(text)

    return await asyncio.gather(*(one(i) for i in range(16)))


async def _with_poison(url: str) -> tuple[list[str], dict[str, httpx.Response]]:
    bad = {name: (path, body) for name, path, body in BAD_INPUTS if name in REFUSED_POISON}
    poison = {name: (CHAT, body) for name, body in FORMERLY_POISON.items()} | bad

    async with httpx.AsyncClient(timeout=120) as client:
        async def send(name: str, path: str, body, delay: float) -> tuple[str, httpx.Response]:
            await asyncio.sleep(delay)  # spread over the healthy streams' lifetime
            if isinstance(body, bytes):
                r = await client.post(f"{url}{path}", content=body, headers={"content-type": "application/json"})
            else:
                r = await client.post(f"{url}{path}", json=body)
            return name, r

        healthy = asyncio.ensure_future(_healthy_streams(url))
        sends = [send(name, path, body, 0.05 * i) for i, (name, (path, body)) in enumerate(poison.items())]
        responses = dict(await asyncio.gather(*sends))
        return await healthy, responses


def test_poison_mixed_into_16_healthy_streams_harms_none_of_them(poison_server):
    url = poison_server.url
    alone = asyncio.run(_healthy_streams(url))
    mixed, responses = asyncio.run(_with_poison(url))
    assert mixed == alone  # every healthy stream complete and identical to the run without poison
    for name in REFUSED_POISON:
        assert 400 <= responses[name].status_code < 500, (name, responses[name].text)
    for name in FORMERLY_POISON:
        assert responses[name].status_code == 200, (name, responses[name].text)
    two = responses["n2-seed-uint64-max"].json()["choices"]
    assert [c["index"] for c in two] == [0, 1]
    content = responses["json-object-ignore-eos"].json()["choices"][0]
    if content["finish_reason"] == "stop":  # the grammar ended the output, ignore_eos or not
        json.loads(content["message"]["content"])
    greedy = post(url, CHAT, chat(temperature=0, max_tokens=12, ignore_eos=True)).json()
    tiny_temperature = responses["temperature-1e-300"].json()
    assert tiny_temperature["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
    assert settle(url) == {"running": 0, "waiting": 0, "kv_cache_usage": 0}
