"""The engine's core contracts: one plan whose row slices are where each sequence's logits are, the same
deltas offline and over the server, and an engine that sleeps and wakes as good as new."""

import asyncio
from dataclasses import replace

import openai
import pytest
import torch

from backend import LLM, SamplingParams
from backend.config import EngineConfig
from backend.engine.llm_engine import LLMEngine
from backend.server.app import build_app
from tests.backend.conftest import prompts_of_lengths
from tests.serving import serve_in_thread, wait_healthy


def test_row_slices_of_a_mixed_plan_are_the_rows_of_each_sequence(tiny_dir, hf_model):
    """Decodes, a verification run with drafts, a whole prompt and a partial prompt chunk in one step; each
    item's logit_rows hold transformers' logits at exactly its positions."""
    directory = tiny_dir("llama")
    reference = hf_model(directory)
    engine = LLMEngine(EngineConfig(model=str(directory), block_size=8, max_num_batched_tokens=32,
                                    speculative={"method": "ngram", "num_tokens": 2}))
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    short_a, short_c, whole, partial = prompts_of_lengths(6, 9, 12, 100)  # whole: within its share of a step
    engine.add_request("a", short_a, greedy)
    engine.add_request("c", short_c, greedy)
    for _ in range(3):
        engine.step_deltas()
    engine.add_request("whole", whole, greedy)
    engine.add_request("partial", partial, greedy)
    a, c = (next(s for s in engine.scheduler.running if s.request_id == rid) for rid in ("a", "c"))
    plan = engine.scheduler.schedule({a.seq_id: 2})
    items = {item.seq.request_id: item for item in plan}
    assert set(items) == {"a", "c", "whole", "partial"} and items["a"].max_drafts == 2
    plan = [replace(item, draft_tokens=[7, 11], num_scheduled_tokens=3) if item is items["a"] else item for item in plan]
    items = {item.seq.request_id: item for item in plan}  # any drafts: their rows are verified
    out = engine.runner.execute(plan)
    logits, rows = out.logits, {item.seq.request_id: r for item, r in zip(plan, out.logit_rows)}

    def expected(tokens: list[int], positions: range) -> torch.Tensor:
        with torch.no_grad():
            return reference(torch.tensor([tokens])).logits[0, list(positions)]

    drafted = a.token_ids + [7, 11]
    torch.testing.assert_close(logits[rows["a"]], expected(drafted, range(a.num_tokens - 1, len(drafted))),
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[rows["c"]], expected(c.token_ids, [c.num_tokens - 1]),
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[rows["whole"]], expected(whole, [len(whole) - 1]),
                               atol=1e-4, rtol=1e-4)
    assert rows["partial"] is None and items["partial"].num_scheduled_tokens < len(partial)
    slices = [rows[r] for r in ("a", "c", "whole")]
    assert [(s.start, s.stop) for s in slices] == [(0, 3), (3, 4), (4, 5)]  # plan order, contiguous
    for rid in items:
        engine.abort_request(rid)


@pytest.fixture(scope="module")
def served(tiny_dir):
    """A real uvicorn server in this process and an offline engine on the same model and settings."""
    config = EngineConfig(model=str(tiny_dir("llama")), block_size=8, max_model_len=256)
    server, _, url = serve_in_thread(build_app(config, "tiny"))
    wait_healthy(url, 120)
    yield url, LLMEngine(config)
    server.should_exit = True


def _offline_deltas(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[str]:
    engine.add_request("offline", prompt, params)
    pieces = []
    while engine.has_unfinished_requests():
        for delta in engine.step_deltas():
            pieces.extend(d.text for d in delta.outputs if d.text)
    return pieces


async def _server_deltas(url: str, messages: list[dict], **fields) -> tuple[list[str], str]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(model="tiny", messages=messages, stream=True, temperature=0,
                                                  **fields)
    pieces, finish = [], None
    async for chunk in stream:
        choice = chunk.choices[0]
        if choice.delta.content:
            pieces.append(choice.delta.content)
        finish = choice.finish_reason or finish
    return pieces, finish


def test_offline_and_server_emit_the_same_deltas_with_stop_strings_held_back(served):
    url, engine = served
    messages = [{"role": "user", "content": "The scribe copied the manuscript"}]
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = engine.tokenizer(text, add_special_tokens=False).input_ids
    full = "".join(_offline_deltas(engine, prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
    stop = full[len(full) // 2:len(full) // 2 + 3]  # a stop string the output is sure to reach
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    offline = _offline_deltas(engine, prompt, params)
    served_pieces, finish = asyncio.run(_server_deltas(url, messages, max_tokens=40, stop=[stop],
                                                       extra_body={"ignore_eos": True}))
    assert served_pieces == offline and finish == "stop"
    assert "".join(offline) == full[:full.index(stop)]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_then_generate_is_identical_to_a_fresh_engine(tiny_dir, level):
    directory = str(tiny_dir("qwen2"))
    prompts = prompts_of_lengths(5, 30)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=1)]
    fresh = LLM(directory, block_size=8, speculative={"method": "ngram"}).generate(prompts, params, use_tqdm=False)
    llm = LLM(directory, block_size=8, speculative={"method": "ngram"})
    llm.generate(prompts, params, use_tqdm=False)  # the prefix cache and speculation state fill up
    llm.engine.sleep(level)
    llm.engine.wake_up()
    again = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(fresh, again):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].text == b.outputs[0].text


def test_after_a_sleep_no_prompt_is_served_from_the_freed_cache_and_the_counters_go_on(tiny_dir):
    """The KV blocks' contents go with the sleep: the same prompt after waking is computed again (a prefix hit would
    read freed blocks), and the prefix cache's counters go on counting over the engine's life, as its other
    statistics do (the disk cache off, so that nothing could serve the prompt but memory)."""
    llm = LLM(str(tiny_dir("llama")), block_size=8, disk_cache_bytes=0)
    prompt, params = prompts_of_lengths(40)[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == 32  # warm: four full blocks
    before = llm.engine.stats()
    llm.engine.sleep(1)
    llm.engine.wake_up()
    woken = llm.generate([prompt], params, use_tqdm=False)[0]
    assert woken.num_cached_tokens == 0 and woken.outputs[0].token_ids == first.outputs[0].token_ids
    after = llm.engine.stats()
    assert after["prefix_cache_hits"] == before["prefix_cache_hits"] > 0
    assert after["prefix_cache_queries"] > before["prefix_cache_queries"]
