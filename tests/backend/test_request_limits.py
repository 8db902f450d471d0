"""What one request may ask of the server, through the official OpenAI SDK on a real server: logit_bias applied,
a completion's prompts capped before they are tokenized, JSON schemas bounded in size and nesting and compiled
where they cannot hold up other requests."""

import threading
import time

import httpx
import openai
import pytest


def detokenized(server, tokens: list[int]) -> str:
    r = httpx.post(f"{server.url}/detokenize", json={"model": "tiny", "tokens": tokens})
    r.raise_for_status()
    return r.json()["prompt"]


def test_logit_bias_steers_the_output(tiny, qwen_server):
    plain = tiny.completions.create(model="tiny", prompt=[11, 12, 13], max_tokens=3, temperature=0)
    forced = tiny.completions.create(model="tiny", prompt=[11, 12, 13], max_tokens=3, temperature=0,
                                     logit_bias={"77": 100})
    assert forced.choices[0].text == detokenized(qwen_server, [77, 77, 77]) != plain.choices[0].text
    chat = tiny.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                        temperature=0, logit_bias={"77": 100})
    assert chat.choices[0].message.content == detokenized(qwen_server, [77, 77])
    with pytest.raises(openai.BadRequestError) as refused:
        tiny.completions.create(model="tiny", prompt="hi", max_tokens=1, logit_bias={"99999999": 1})
    assert "token id 99999999 is not in the vocabulary" in str(refused.value)


def test_a_completion_takes_a_bounded_number_of_prompts(tiny):
    with pytest.raises(openai.BadRequestError) as refused:
        tiny.completions.create(model="tiny", prompt=["hi"] * 1000, max_tokens=1)
    assert "1000 sequences" in str(refused.value) and "--max-prompts" in str(refused.value)
    with pytest.raises(openai.BadRequestError) as refused:
        tiny.completions.create(model="tiny", prompt=["hi"] * 100, max_tokens=1, n=2)
    assert "200 sequences (100 prompts, n=2)" in str(refused.value)
    assert len(tiny.completions.create(model="tiny", prompt=["hi"] * 4, max_tokens=1).choices) == 4


def test_schemas_are_bounded_in_size_and_depth(tiny):
    huge = {"type": "object", "properties": {"pick": {"enum": [f"choice-{i}" for i in range(30000)]}}}
    with pytest.raises(openai.BadRequestError) as refused:
        tiny.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                     response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                                             "schema": huge}})
    assert "--max-schema-bytes" in str(refused.value)
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "array", "items": deep}
    with pytest.raises(openai.BadRequestError) as refused:
        tiny.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                     response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                                             "schema": deep}})
    assert "nests more than 32 levels" in str(refused.value)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def slow_compile(tiny, seed: int, compiles: list[float]) -> None:
    """A request whose schema takes long to compile (many patterns, under the size limit); appends its seconds."""
    started = time.perf_counter()
    # patterns of its own: neither our cache of grammars nor xgrammar's of rules has any of it
    varied = {"type": "object", "properties": {
        f"p{k}": {"type": "string", "pattern": f"^([a-z]{{1,{seed + 8}}}-){{0,20}}[0-9]{{2,{k % 7 + 9}}}$"}
        for k in range(400)}, "required": ["p0"]}
    tiny.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                 response_format=schema_format(varied))
    compiles.append(time.perf_counter() - started)


def test_slow_schema_compiles_do_not_hold_up_other_requests(tiny):
    """Two requests whose schemas take long to compile beside a plain one: the plain one's answer does not wait
    for them. The bound (a quarter of what the compiles take) is the behaviour: before, they shared the
    tokenizing threads, and the plain request waited for both compiles."""
    compiles: list[float] = []
    threads = [threading.Thread(target=slow_compile, args=(tiny, i, compiles)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    started = time.perf_counter()
    tiny.completions.create(model="tiny", prompt="hello there", max_tokens=1)
    plain = time.perf_counter() - started
    for t in threads:
        t.join()
    assert plain < max(compiles) / 4, (plain, compiles)


def test_a_compiled_schema_and_an_oversized_one_do_not_wait_behind_a_compile(tiny):
    """Schemas compile one at a time on the grammar thread. A schema compiled before (an agent's tools, sent every
    turn) is answered from the cache, and one past the size limit refused, without waiting for another request's
    slow compile (before, both queued behind it, and timed out as "took longer" when it outlasted the limit)."""
    known = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    chat = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    tiny.chat.completions.create(**chat, response_format=schema_format(known))  # compiled and kept
    compiles: list[float] = []
    thread = threading.Thread(target=slow_compile, args=(tiny, 7, compiles))
    thread.start()
    time.sleep(0.2)
    started = time.perf_counter()
    tiny.chat.completions.create(**chat, response_format=schema_format(known))
    cached = time.perf_counter() - started
    huge = {"type": "object", "properties": {"pick": {"enum": [f"choice-{i}" for i in range(30000)]}}}
    started = time.perf_counter()
    with pytest.raises(openai.BadRequestError, match="--max-schema-bytes"):
        tiny.chat.completions.create(**chat, response_format=schema_format(huge))
    refused = time.perf_counter() - started
    thread.join()
    assert max(cached, refused) < compiles[0] / 4, (cached, refused, compiles)
