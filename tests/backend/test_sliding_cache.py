"""The sliding group of the KV cache (engine/cache_groups.py, engine/window_blocks.py): sliding-window layers keep
only the blocks their window still reads, in a pool of their own. Tiny Gemma 3 (window 12, 2 of 3 layers sliding)
and gpt-oss (window 12, every other layer) against transformers on prompts several windows long; the block
manager's own counts; the prefix cache's hits, whole and capped; the memory accounting."""

import logging

import pytest
import torch

from backend import LLM, SamplingParams
from backend.config import EngineConfig
from backend.engine.block_manager import BlockManager
from backend.engine.cache_groups import SlidingGroup, blocks_a_sequence
from backend.engine.kv_budget import kv_bytes_per_block
from backend.engine.sequence import Sequence
from backend.kernels import native
from backend.server.memory_need import model_need
from tests.backend.conftest import hf_greedy, interpreted_only, prompts_of_lengths
from tests.backend.cuda_emulation import capture_graphs, emulate_cuda, replays

# A step of 16 tokens: each sequence needs blocks_a_sequence(12, 16, 8) = 5 sliding blocks where max_model_len
# (512) takes 64, so the sliding group is on; prompts cross the window's edge chunk by chunk.
SETTINGS = dict(block_size=8, max_num_batched_tokens=16)
PROMPTS = prompts_of_lengths(5, 45, 77, 100)
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0)


def cache_bytes(llm) -> int:
    return sum(
        t.numel() * t.element_size()
        for layer in llm.engine.model.model.layers
        for t in (layer.self_attn.k_cache, layer.self_attn.v_cache)
    )


def assert_as_transformers(reference, prompts, outputs) -> None:
    """Greedy tokens identical to transformers', each token's logprob within 1e-4 of transformers' (outputs: the
    requests' outputs, or sequences' completions)."""
    for prompt, out in zip(prompts, outputs, strict=True):
        out = out.outputs[0] if hasattr(out, "outputs") else out
        tokens = out.token_ids
        assert tokens == hf_greedy(reference, prompt, len(tokens))
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens])).logits[0].float()
        expected = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1].gather(
            1, torch.tensor(tokens)[:, None]
        )
        ours = torch.tensor([entry[t].logprob for entry, t in zip(out.logprobs, tokens)])
        torch.testing.assert_close(ours, expected[:, 0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss"])
def test_long_prompts_batched_and_chunked_match_transformers(family, tiny_dir, hf_model):
    """Prompts of 5 to 100 tokens batched in 16-token steps (chunks across the window's edge beside decodes), and
    a request of n=2 whose second sequence forks off the first's partial block (copied in both groups)."""
    directory = tiny_dir(family)
    llm = LLM(str(directory), **SETTINGS)
    engine = llm.engine
    sliding = engine.runner.sliding
    assert sliding is not None and sliding.window == 12
    for layer, spec in zip(engine.model.model.layers, engine.model_config.layers):
        rows = sliding.num_blocks if spec.attention.kind == "sliding" else engine.num_kv_blocks
        assert layer.self_attn.k_cache.shape[0] == rows
    assert sliding.num_blocks < engine.num_kv_blocks
    reference = hf_model(directory)
    assert_as_transformers(reference, PROMPTS, llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    pair = llm.generate(
        PROMPTS[1],
        SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True, logprobs=0),
        use_tqdm=False,
    )[0]
    assert_as_transformers(reference, [PROMPTS[1]] * 2, pair.outputs)
    assert engine.block_manager.window.held() == 0  # every finished sequence gave its sliding blocks back


@pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")
def test_every_layer_sliding_through_the_one_call_step_decodes_as_one_pool(tiny_dir):
    """Mistral's window (24) on every layer, int8 (a model the one-call C step takes): its decode steps read the
    sliding group's slots and tables (cpu_decoder.c), and decode as the same model keeping every block in one
    pool (512-token steps: no group) does."""
    directory = str(tiny_dir("mistral"))
    grouped = LLM(directory, **SETTINGS, quantization="int8")
    assert grouped.engine.runner.sliding is not None and grouped.engine.runner.cpu_decoder is not None
    one_pool = LLM(directory, block_size=8, quantization="int8")
    assert one_pool.engine.runner.sliding is None
    ours = grouped.generate(PROMPTS, GREEDY, use_tqdm=False)
    for a, b in zip(one_pool.generate(PROMPTS, GREEDY, use_tqdm=False), ours, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)


def test_a_long_sequence_holds_a_bounded_number_of_sliding_blocks(tiny_dir):
    """A 300-token prompt and 30 decoded tokens: the full group's table grows with it, the sliding group's
    held blocks (the block manager's count) never pass what one step's queries read."""
    llm = LLM(str(tiny_dir("gemma3")), **SETTINGS)
    engine, manager = llm.engine, llm.engine.block_manager
    engine.add_request(
        "long", prompts_of_lengths(300)[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    )
    held, tables = [], []
    while engine.has_unfinished_requests():
        engine.step()
        held.append(manager.window.held())
        tables.append(manager.num_blocks - manager.num_free_blocks)
    assert max(held) <= blocks_a_sequence(12, 16, 8) < 10
    assert max(tables) >= 329 // 8  # the full group keeps every position's block
    assert held[-1] == 0


def test_prefix_hits_whole_and_capped_match_transformers(tiny_dir, hf_model):
    """A hit is served as far as the sliding group still holds the window before its end: the whole 56-token
    prefix just after the first prompt ran, nothing once another prompt has reused the group's 10 blocks (the full
    group still holds the prefix); both decode as transformers does."""
    directory = tiny_dir("gemma3")
    reference = hf_model(directory)
    llm = LLM(str(directory), **SETTINGS, max_num_seqs=2)
    assert llm.engine.runner.sliding.num_blocks == 2 * blocks_a_sequence(12, 16, 8)
    prefix = prompts_of_lengths(60)[0]
    llm.generate(prefix + [7, 8, 9], SamplingParams(max_tokens=1), use_tqdm=False)
    second = prefix + [11, 12, 13, 14, 15]
    whole = llm.generate(second, GREEDY, use_tqdm=False)[0]
    assert whole.num_cached_tokens == 56
    llm.generate(prompts_of_lengths(120)[0], SamplingParams(max_tokens=1), use_tqdm=False)
    third = prefix + [21, 22, 23]
    capped = llm.generate(third, GREEDY, use_tqdm=False)[0]
    assert capped.num_cached_tokens == 0
    assert_as_transformers(reference, [second, third], [whole, capped])


def _run(manager: BlockManager, seq: Sequence, chunk: int = 16) -> None:
    """Compute the sequence's prompt chunk by chunk as the scheduler does (allocate, then append each step)."""
    assert manager.allocate(seq, *manager.find_cached_prefix(seq), min(chunk, seq.num_tokens))
    while True:
        seq.num_computed_tokens = min(seq.num_computed_tokens + chunk, seq.num_tokens)
        manager.hash_full_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            return
        assert manager.append_slots(seq, min(chunk, seq.num_tokens - seq.num_computed_tokens))


def _sequence(tokens: list[int]) -> Sequence:
    return Sequence(0, "r", 0, list(tokens), len(tokens), SamplingParams())


def test_a_hit_is_capped_where_the_sliding_group_lost_a_window_block():
    """The full group holds all 7 blocks of a 56-token prefix; the sliding group lost block 5 (reused) but kept
    blocks 3 and 4 (revived by a hit and given back later, so reused last): the hit stops at 5 blocks, whose last
    window (positions 29..39) the group holds, and the new sequence shares those two blocks."""
    manager = BlockManager(64, 8, sliding=SlidingGroup(window=12, num_blocks=16))
    window = manager.window
    a = list(range(100, 180))
    first = _sequence(a)
    _run(manager, first)
    manager.free_sequence(first)
    revived = _sequence(a[:40] + [1] * 8)
    hit_ids, hit_hashes = manager.find_cached_prefix(revived)
    assert len(hit_ids) == 5  # whole: the window before token 40 is blocks 3 and 4, still held
    assert manager.allocate(revived, hit_ids, hit_hashes, 8)
    kept = revived.window_table[3:5]
    manager.free_sequence(revived)
    other = _sequence(list(range(500, 580)))
    assert manager.allocate(other, [], [], 80)  # 10 blocks: the 6 never used, then first's blocks 0, 1, 2, 5
    capped = _sequence(a[:56] + [2] * 8)
    hit_ids, hit_hashes = manager.find_cached_prefix(capped)
    assert len(hit_ids) == 5
    assert manager.allocate(capped, hit_ids, hit_hashes, 24)
    assert capped.window_table[:3] == [-1, -1, -1] and capped.window_table[3:5] == kept
    assert all(window.refs[b] == 1 for b in kept)


def test_preemption_and_ngram_speculation_decode_as_transformers(tiny_dir, hf_model):
    """A full group of 24 blocks for three prompts of 45 to 100 tokens: sequences are preempted and computed
    again; then n-gram drafts verified across the window's edge: plain decoding's tokens and logprobs."""
    directory = tiny_dir("gpt_oss")
    reference = hf_model(directory)
    small = LLM(str(directory), **SETTINGS, max_model_len=160, num_kv_blocks=24)
    assert small.engine.runner.sliding is not None
    outputs = small.generate(PROMPTS[1:], GREEDY, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert_as_transformers(reference, PROMPTS[1:], outputs)
    repeating = [prompts_of_lengths(20)[0] * 3, prompts_of_lengths(9)[0] * 5]
    plain = LLM(str(directory), **SETTINGS).generate(repeating, GREEDY, use_tqdm=False)
    spec = LLM(
        str(directory), **SETTINGS, speculative={"method": "ngram", "num_tokens": 4, "prompt_lookup_min": 1}
    )
    drafted = spec.generate(repeating, GREEDY, use_tqdm=False)
    for a, b in zip(plain, drafted):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    assert spec.engine.stats()["spec_accepted_tokens"] > 0
    assert_as_transformers(reference, repeating, drafted)


def test_memory_need_budget_and_ready_log_count_each_group(tiny_dir, caplog):
    """--print-memory-need's KV cache is what an engine of the smallest cache allocates, less than every layer
    keeping every block (4 sequences' sliding blocks, 20, against the 64 of one sequence of max_model_len); a byte
    budget holds both groups and gives the full group more blocks than it would get if the sliding layers kept
    every block; the ready log names both groups."""
    directory = str(tiny_dir("gemma3"))
    settings = dict(**SETTINGS, max_model_len=512, max_num_seqs=4)
    need = model_need("m", EngineConfig(model=directory, **settings))
    caplog.set_level(logging.INFO)
    smallest = LLM(directory, **settings, num_kv_blocks=64)
    cfg = smallest.engine.model_config
    everything = 64 * kv_bytes_per_block(cfg, 8, torch.float32)
    assert cache_bytes(smallest) == need.kv_cache < everything
    sliding = smallest.engine.runner.sliding
    assert f"sliding-window layers {sliding.num_blocks} blocks of their own" in caplog.text
    budget = 4 * everything
    budgeted = LLM(directory, **settings, kv_cache_memory=budget)
    assert cache_bytes(budgeted) <= budget
    assert budgeted.engine.num_kv_blocks > budget // kv_bytes_per_block(cfg, 8, torch.float32)


def test_no_group_where_the_window_and_a_step_reach_the_whole_context(tiny_dir):
    """512-token steps read as far back as max_model_len does: nothing to free, one pool as before."""
    llm = LLM(str(tiny_dir("gemma3")), block_size=8)
    assert llm.engine.runner.sliding is None and llm.engine.block_manager.window is None


def test_a_model_with_a_sliding_group_writes_no_disk_entries(tiny_dir):
    """A disk entry would need the sliding group's blocks of the window before its end: none is written or read
    for such a model; the same model without a group (512-token steps) keeps its disk cache."""
    directory = str(tiny_dir("gemma3"))
    grouped = LLM(directory, **SETTINGS, disk_cache_bytes=1 << 24)
    assert grouped.engine.disk_cache is None and grouped.engine.block_manager.disk is None
    assert LLM(directory, block_size=8, disk_cache_bytes=1 << 24).engine.block_manager.disk is not None


@interpreted_only
def test_the_cuda_path_reads_the_sliding_groups_tables(tiny_dir, monkeypatch):
    """Triton kernels (interpreted) and captured decode graphs with the sliding group on: the CPU path's tokens."""
    directory = str(tiny_dir("gemma3"))
    settings = dict(block_size=16, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=256)
    prompts = PROMPTS[1:3]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids for o in LLM(directory, **settings).generate(prompts, params, use_tqdm=False)
    ]
    emulate_cuda(monkeypatch)
    llm = LLM(directory, **settings)
    assert llm.engine.runner.sliding is not None
    [runner] = capture_graphs(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert replays(runner) > 0
