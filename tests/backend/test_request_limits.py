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


def test_slow_schema_compiles_do_not_hold_up_other_requests(tiny):
    """Two requests whose schemas take long to compile (many patterns, under the size limit) beside a plain one:
    the plain one's answer does not wait for them. The bound (a quarter of what the compiles take) is the
    behaviour: before, they shared the tokenizing threads, and the plain request waited for both compiles."""
    compiles: list[float] = []

    def slow(seed: int) -> None:
        started = time.perf_counter()
        # patterns of its own: neither our cache of grammars nor xgrammar's of rules has any of it
        varied = {"type": "object", "properties": {
            f"p{k}": {"type": "string", "pattern": f"^([a-z]{{1,{seed + 8}}}-){{0,20}}[0-9]{{2,{k % 7 + 9}}}$"}
            for k in range(400)}, "required": ["p0"]}
        tiny.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                     response_format={"type": "json_schema",
                                                      "json_schema": {"name": "x", "schema": varied}})
        compiles.append(time.perf_counter() - started)

    threads = [threading.Thread(target=slow, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    started = time.perf_counter()
    tiny.completions.create(model="tiny", prompt="hello there", max_tokens=1)
    plain = time.perf_counter() - started
    for t in threads:
        t.join()
    assert plain < max(compiles) / 4, (plain, compiles)
