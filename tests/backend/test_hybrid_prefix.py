"""Prefix hits of hybrid models (engine/state_snapshots.py): a prompt's prefill leaves a snapshot of the linear
layers' states at its last full block before its last token, and a later prompt whose cached full-attention
blocks reach a snapshot resumes from it. Greedy tokens and logprobs as transformers computes the whole prompt,
with the hit reported; the hit cut back to the snapshot; the snapshots bounded; preemption and n-gram speculation
as exact as without a hit."""

import pytest

from backend import LLM, SamplingParams
from backend.engine.block_manager import chain_hash
from backend.engine.state_pool import SNAPSHOT_SLOTS, state_bytes_per_sequence, state_pool_bytes
from tests.backend.conftest import interpreted_only, prompts_of_lengths
from tests.backend.cuda_emulation import emulate_cuda
from tests.backend.test_hybrid_linear import _assert_pool_free, _assert_same_decoding, _hf_check

BLOCK = 8
FIRST = prompts_of_lengths(70)[0]  # its snapshot: after 64 tokens (8 blocks; one token is always computed)
OTHER = prompts_of_lengths(30, vocab=300)[0]  # tokens that continue FIRST differently


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)


def _cached_blocks(llm: LLM, prompt: list[int]) -> int:
    """How many of the prompt's leading full blocks the full-attention layers' cache holds, snapshot or not."""
    parent = None
    for i in range((len(prompt) - 1) // BLOCK):
        parent = chain_hash(parent, tuple(prompt[i * BLOCK : (i + 1) * BLOCK]))
        if parent not in llm.engine.block_manager.cached:
            return i
    return (len(prompt) - 1) // BLOCK


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_a_longer_prompt_resumes_from_the_snapshot(family, tiny_dir, hf_model):
    """The next turn of a conversation (the first prompt and more) computes only what follows the snapshot, and
    gives transformers' tokens and logprobs for its whole prompt."""
    directory = tiny_dir(family)
    llm = LLM(str(directory), block_size=BLOCK, max_num_batched_tokens=24, max_num_seqs=4)
    llm.generate(FIRST, _greedy(4), use_tqdm=False)
    second = FIRST + OTHER
    out = llm.generate(second, _greedy(10), use_tqdm=False)[0]
    assert out.num_cached_tokens == 64 and llm.engine.block_manager.prefix_hits == 64
    assert llm.engine.block_manager.snapshots.resumes == 1
    _hf_check(hf_model(directory), second, out)
    _assert_pool_free(llm)


def test_a_hit_is_cut_back_to_the_snapshot_before_it(tiny_dir, hf_model):
    """Blocks cached past the snapshot (the first request's output) and a prompt diverging inside the block after
    it both resume at the snapshot's boundary, 64 tokens."""
    directory = tiny_dir("qwen3_next")
    llm = LLM(str(directory), block_size=BLOCK, max_num_seqs=4)
    first = llm.generate(FIRST, _greedy(6), use_tqdm=False)[0].outputs[0].token_ids
    with_output = FIRST + first + OTHER[:10]
    assert _cached_blocks(llm, with_output) == 9  # 72 tokens of full-attention cache, a snapshot at 64
    diverging = FIRST[:68] + OTHER  # differs from FIRST at position 68, inside the block from 64 to 72
    outs = [llm.generate(p, _greedy(8), use_tqdm=False)[0] for p in (with_output, diverging)]
    assert [o.num_cached_tokens for o in outs] == [64, 64]
    for prompt, out in zip((with_output, diverging), outs):
        _hf_check(hf_model(directory), prompt, out)


def test_snapshots_are_bounded_and_the_least_recently_used_goes_first(tiny_dir):
    llm = LLM(str(tiny_dir("qwen3_5_moe")), block_size=BLOCK, max_num_seqs=2)
    cfg, bm = llm.engine.model_config, llm.engine.block_manager
    layer = llm.engine.model.model.layers[0].self_attn
    assert layer.delta_state.shape[0] == 2 + SNAPSHOT_SLOTS  # the sequences' slots, then the snapshots'
    assert state_pool_bytes(cfg, 2) == (2 + SNAPSHOT_SLOTS) * state_bytes_per_sequence(cfg)
    prompts = prompts_of_lengths(*range(17, 18 + SNAPSHOT_SLOTS))  # one more than the slots, each its own
    for prompt in prompts:
        assert llm.generate(prompt, _greedy(2), use_tqdm=False)[0].num_cached_tokens == 0
    assert len(bm.snapshots.held) == SNAPSHOT_SLOTS and not bm.snapshots.free
    newest, oldest, second = prompts[-1], prompts[0], prompts[1]
    held = (len(newest) - 1) // BLOCK * BLOCK
    assert llm.generate(newest, _greedy(2), use_tqdm=False)[0].num_cached_tokens == held  # still held
    assert _cached_blocks(llm, oldest) == 2  # its blocks are cached: the snapshot is what went
    assert llm.generate(oldest, _greedy(2), use_tqdm=False)[0].num_cached_tokens == 0
    # taking the oldest's snapshot again evicted the least recently used one: the second prompt's, not the newest's
    assert llm.generate(second, _greedy(2), use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate(newest, _greedy(2), use_tqdm=False)[0].num_cached_tokens == held
    assert len(bm.snapshots.held) == SNAPSHOT_SLOTS


def test_preempted_sequences_recompute_from_a_snapshot_exactly(tiny_dir, hf_model):
    """Three prompts sharing 24 tokens that a first request left a snapshot of, in a cache too small for them:
    preempted sequences come back from a snapshot (more resumes than admissions), with transformers' tokens."""
    directory = tiny_dir("qwen3_5_moe")
    shared = prompts_of_lengths(24)[0]
    tight = LLM(str(directory), block_size=BLOCK, num_kv_blocks=12, max_model_len=72, max_num_seqs=4)
    tight.generate(shared + OTHER[:3], _greedy(1), use_tqdm=False)
    prompts = [shared + tail for tail in prompts_of_lengths(7, 9, 11, vocab=250)]
    outputs = tight.generate(prompts, _greedy(30), use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.num_cached_tokens for o in outputs] == [24] * 3
    assert tight.engine.block_manager.snapshots.resumes > len(prompts)
    for prompt, out in zip(prompts, outputs):
        _hf_check(hf_model(directory), prompt, out)
    _assert_pool_free(tight)


def test_ngram_speculation_after_a_hit_gives_plain_decodings_tokens(tiny_dir):
    directory = str(tiny_dir("qwen3_next"))
    ngram = {"method": "ngram", "num_tokens": 8, "prompt_lookup_min": 1}
    spec = LLM(directory, block_size=BLOCK, max_num_seqs=4, speculative=ngram)
    plain = LLM(directory, block_size=BLOCK, max_num_seqs=4)
    repeating = FIRST[:30] * 2 + OTHER  # the n-gram lookup finds drafts in it
    for llm in (spec, plain):
        llm.generate(repeating[:50], _greedy(2), use_tqdm=False)  # a snapshot after 48 tokens
    ours, theirs = (llm.generate(repeating, _greedy(40), use_tqdm=False) for llm in (spec, plain))
    assert ours[0].num_cached_tokens == theirs[0].num_cached_tokens == 48
    _assert_same_decoding(ours, theirs)
    stats = spec.engine.stats()
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"] and stats["spec_verifications"] > 0
    _assert_pool_free(spec)


def test_without_prefix_caching_no_snapshot_is_taken(tiny_dir):
    llm = LLM(str(tiny_dir("qwen3_next")), block_size=BLOCK, enable_prefix_caching=False)
    for _ in range(2):
        assert llm.generate(FIRST, _greedy(2), use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.engine.block_manager.snapshots is None


@interpreted_only
def test_the_cuda_path_resumes_from_a_snapshot(tiny_dir, monkeypatch):
    """The Triton kernels (interpreted) read the hit's full-attention blocks beside the resumed states: the CPU
    path's greedy tokens."""
    directory, settings = str(tiny_dir("qwen3_5_moe")), dict(block_size=16, max_num_seqs=2)
    prompts = [FIRST[:40], FIRST[:40] + OTHER[:10]]  # a snapshot after 32 tokens, then a hit on it

    def run(llm: LLM) -> list:
        return [llm.generate(p, _greedy(5), use_tqdm=False)[0] for p in prompts]

    expected = [o.outputs[0].token_ids for o in run(LLM(directory, **settings))]
    emulate_cuda(monkeypatch)
    outs = run(LLM(directory, **settings))
    assert [o.outputs[0].token_ids for o in outs] == expected and outs[1].num_cached_tokens == 32
