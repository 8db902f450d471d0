"""Prefix caching, preemption and abort, checked against cold and unconstrained runs."""

import pytest

from backend import LLM, SamplingParams
from backend.engine.block_manager import BlockManager
from backend.engine.sequence import Sequence
from tests.backend.conftest import hf_greedy, prompts_of_lengths

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_shared_prefix_reuses_blocks_and_matches_a_cold_run(tiny_dir):
    directory = tiny_dir("llama")
    prefix = prompts_of_lengths(100)[0]
    first, second = prefix + [7, 8, 9], prefix + [11, 12, 13, 14, 15]
    warm = LLM(str(directory), block_size=8)
    warm.generate(first, GREEDY, use_tqdm=False)
    hits_before = warm.engine.block_manager.prefix_hits
    out = warm.generate(second, GREEDY, use_tqdm=False)[0]
    # 100 shared tokens = 12 full blocks of 8; the 13th block differs.
    assert out.num_cached_tokens == 96
    assert warm.engine.block_manager.prefix_hits - hits_before == 96

    cold = LLM(str(directory), block_size=8, enable_prefix_caching=False)
    expected = cold.generate(second, GREEDY, use_tqdm=False)[0]
    assert expected.num_cached_tokens == 0
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids


def test_identical_prompt_is_served_from_cache_except_its_last_token(tiny_dir):
    llm = LLM(str(tiny_dir("llama")), block_size=8)
    prompt = prompts_of_lengths(40)[0]  # exactly 5 blocks
    a = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    b = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert b.num_cached_tokens == 32  # the last block is recomputed: its last token's logits are needed
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_preemption_gives_unconstrained_output_and_frees_every_block(tiny_dir, hf_model):
    directory = tiny_dir("mistral")
    prompts = prompts_of_lengths(20, 27, 35, 41, 12, 30)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # Each sequence grows to ~80 tokens = 10 blocks of 8; 14 blocks cannot hold even two of them at full length.
    tight = LLM(str(directory), block_size=8, num_kv_blocks=14, max_model_len=100)
    outputs = tight.generate(prompts, params, use_tqdm=False)
    engine = tight.engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    reference = hf_model(directory)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 40)


def test_kv_cache_too_small_for_one_sequence_is_refused(tiny_dir):
    with pytest.raises(ValueError, match="max_model_len=256 needs 32"):
        LLM(str(tiny_dir("llama")), block_size=8, num_kv_blocks=10, max_model_len=256)


def test_abort_at_any_time_frees_blocks_and_leaves_others_intact(tiny_dir):
    llm = LLM(str(tiny_dir("qwen2")), block_size=8, max_num_batched_tokens=16)
    engine = llm.engine
    prompts = prompts_of_lengths(30, 45, 9)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = llm.generate(prompts[2], params, use_tqdm=False)[0].outputs[0].token_ids

    engine.add_request("waiting", prompts[1] + [1], params)
    engine.add_request("prefilling", prompts[1], params)
    engine.add_request("kept", prompts[2], params)
    engine.add_request("decoding", prompts[0], params)
    engine.step()  # budget 16: "waiting" takes all of it
    engine.abort_request("waiting")  # mid-prefill
    for _ in range(6):
        engine.step()
    decoding = next(s for s in engine.scheduler.running if s.request_id == "decoding")
    assert decoding.num_output_tokens > 0
    engine.abort_request("decoding")  # mid-decode
    engine.abort_request("prefilling")
    result = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                result = out
    assert result.request_id == "kept"
    assert result.outputs[0].token_ids == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def _seq(tokens: list[int]) -> Sequence:
    return Sequence(seq_id=0, request_id="r", index=0, token_ids=list(tokens), num_prompt_tokens=len(tokens),
                    params=SamplingParams())


def test_freed_cached_blocks_are_reused_least_recently_freed_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = _seq([1, 2, 3, 4]), _seq([5, 6, 7, 8])
    for seq in (a, b):
        assert bm.allocate(seq, [], [], 4)
        seq.num_computed_tokens = 4
        bm.hash_full_blocks(seq)
    assert bm.num_free_blocks == 0 and not bm.allocate(_seq([9, 10, 11]), [], [], 3)
    bm.free_sequence(a)  # freed first, so evicted first
    bm.free_sequence(b)
    assert len(bm.find_cached_prefix(_seq([1, 2, 3, 4, 99]))[0]) == 2  # freed blocks still serve hits
    assert bm.allocate(_seq([9, 10, 11]), [], [], 3)  # takes two blocks: a's
    assert bm.find_cached_prefix(_seq([1, 2, 3, 4, 99]))[0] == []
    assert len(bm.find_cached_prefix(_seq([5, 6, 7, 8, 99]))[0]) == 2


def test_hash_collision_never_serves_wrong_tokens(monkeypatch):
    import backend.engine.block_manager as module

    monkeypatch.setattr(module, "chain_hash", lambda parent, tokens: 42)  # every block collides
    bm = BlockManager(num_blocks=8, block_size=2)
    a = _seq([1, 2, 3])
    assert bm.allocate(a, [], [], 3)
    a.num_computed_tokens = 3
    bm.hash_full_blocks(a)
    assert bm.find_cached_prefix(_seq([1, 2, 9]))[0] == [a.block_table[0]]
    assert bm.find_cached_prefix(_seq([5, 6, 9]))[0] == []  # same hash, other tokens: a miss


def _count_computed(llm) -> list[int]:
    """Wrap the runner so each step's computed token count is recorded."""
    counts, execute = [], llm.engine.runner.execute

    def counting(batch):
        counts.append(sum(item.num_scheduled_tokens for item in batch))
        return execute(batch)

    llm.engine.runner.execute = counting
    return counts


@pytest.mark.parametrize("prompt_len", [35, 32])  # a partial last block (copied) and none
def test_n_siblings_prefill_the_prompt_once_and_match_separate_seeded_requests(tiny_dir, prompt_len):
    llm = LLM(str(tiny_dir("llama")), block_size=8)
    prompt = prompts_of_lengths(prompt_len)[0]
    counts = _count_computed(llm)
    params = dict(temperature=1.0, max_tokens=10, ignore_eos=True)
    out = llm.generate(prompt, SamplingParams(n=3, seed=5, **params), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    # One prefill of the prompt, then the three decode together: 3 tokens a step for the 9 further tokens.
    assert counts == [prompt_len] + [3] * 9
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    # Sibling i is exactly the request with seed 5 + i (the oracle: each prefilled on its own).
    fresh = LLM(str(tiny_dir("llama")), block_size=8, enable_prefix_caching=False)
    for i, o in enumerate(out.outputs):
        alone = fresh.generate(prompt, SamplingParams(n=1, seed=5 + i, **params), use_tqdm=False)[0].outputs[0]
        assert o.token_ids == alone.token_ids


def test_n_siblings_without_a_free_block_queue_and_find_the_prompt_cached(tiny_dir):
    # Room for the leader's prompt and its decode only: the siblings cannot get a copy of its partial block
    # at once, so they queue and later find the prompt's full blocks in the prefix cache.
    llm = LLM(str(tiny_dir("llama")), block_size=8, num_kv_blocks=5, max_model_len=40)
    prompt = prompts_of_lengths(35)[0]
    out = llm.generate(prompt, SamplingParams(n=2, temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids  # greedy: the same continuation
    assert llm.engine.block_manager.prefix_hits == 32
    assert llm.engine.block_manager.num_free_blocks == 5
