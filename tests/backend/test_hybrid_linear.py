"""Hybrid linear attention (Qwen3-Next, Qwen3.5-MoE; the delta rule itself: test_delta_rule.py): the family
reader, and the engine's per-sequence state pool: greedy tokens and logprobs as
transformers computes them, with prompts in chunks across steps beside decodes, preemption and recomputation,
n > 1, a repeat's prefix hit (test_hybrid_prefix.py), the pool freed, its bytes counted, and speculation as lossless as plain decoding."""

import json
import math

import pytest
import torch

from backend import LLM, SamplingParams
from backend.engine.state_pool import SNAPSHOT_SLOTS, state_bytes_per_sequence, state_pool_bytes
from backend.hf_config import from_hf_config
from backend.layer_spec import DeltaNetShape
from tests.backend.conftest import interpreted_only, prompts_of_lengths
from tests.backend.cuda_emulation import cpu_tokens_then_emulated, greedy_tokens
from tests.backend.test_models_vs_transformers import HYBRID_TOLERANCE

HYBRIDS = ["qwen3_next", "qwen3_5_moe"]
PROMPTS = prompts_of_lengths(1, 23, 41, 70)  # block_size 8, chunks of 12: across blocks, chunks and steps


def test_hybrid_families_read_into_layer_kinds(tiny_dir):
    nxt = from_hf_config(json.loads((tiny_dir("qwen3_next") / "config.json").read_text()), "qwen3_next")
    shape = DeltaNetShape(
        num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=8, conv_kernel=4,
        grouped_projections=True,
    )
    assert [s.attention.kind for s in nxt.layers] == ["linear"] * 3 + ["full"]
    assert {s.attention.linear for s in nxt.layers[:3]} == {shape}
    full = nxt.layers[3].attention
    assert (full.output_gate, full.qk_norm) == (True, "head")
    assert [s.mlp.kind for s in nxt.layers] == ["moe", "dense", "moe", "moe"]  # mlp_only_layers=[1]
    assert (nxt.rotary_dim, nxt.head_dim, nxt.norm_unit_offset, nxt.shared_expert_intermediate_size) == (
        4,
        16,
        True,
        48,
    )
    cfg = json.loads((tiny_dir("qwen3_5_moe") / "config.json").read_text())
    qwen35 = from_hf_config(cfg, "qwen3_5_moe")
    assert [s.mlp.kind for s in qwen35.layers] == ["moe"] * 4 and qwen35.norm_topk_prob
    # the multimodal checkpoint's form: the same text model under text_config
    wrapped = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "eos_token_id": 7,
        "text_config": {k: v for k, v in cfg.items() if k not in ("architectures", "eos_token_id")},
    }
    text = from_hf_config(wrapped, "qwen3_5_moe")
    assert text.layers == qwen35.layers and text.eos_token_ids == [7]


def _hf_check(reference, prompt: list[int], out) -> None:
    """Our greedy tokens are transformers' argmax at every step, and their logprobs its log-softmax, within the hybrids'
    bound (test_models_vs_transformers.HYBRID_TOLERANCE): on an Intel Xeon (2026-12-07) the preemption test's 35-token
    prompt and its 30 tokens came 1.12e-4 off at one position, with torch's kernels as with ours: fp32 rounding of
    transformers' chunked delta rule over the whole sequence against our recurrent steps, carried over 65 positions."""
    tokens = out.outputs[0].token_ids
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    assert tokens == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), torch.tensor(tokens)]
    ours = torch.tensor([entry[t].logprob for entry, t in zip(out.outputs[0].logprobs, tokens)])
    torch.testing.assert_close(ours, expected, atol=HYBRID_TOLERANCE, rtol=0)


def _assert_pool_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.states.num_free == bm.states.num_slots == llm.engine.config.max_num_seqs
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("family", HYBRIDS)
def test_chunked_prompts_beside_decodes_match_transformers(family, tiny_dir, hf_model):
    """Prompts of 1 (a first row that decodes) to 70 tokens in chunks of at most 12 across steps, batched with each other's decodes."""
    directory = tiny_dir(family)
    llm = LLM(str(directory), block_size=8, max_num_batched_tokens=12, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        _hf_check(hf_model(directory), prompt, out)
    _assert_pool_free(llm)


def test_preemption_recomputes_the_state_from_the_first_token(tiny_dir, hf_model):
    directory = tiny_dir("qwen3_5_moe")
    prompts = prompts_of_lengths(20, 27, 35, 12)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=0)
    # Each sequence grows to ~60 tokens = 8 blocks of 8; 10 blocks cannot hold two of them at full length.
    tight = LLM(str(directory), block_size=8, num_kv_blocks=10, max_model_len=72, max_num_seqs=4)
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outputs):
        _hf_check(hf_model(directory), prompt, out)
    _assert_pool_free(tight)


def test_siblings_and_repeated_prompts_prefill_their_own_state(tiny_dir):
    """n = 2 greedy siblings both give the lone sequence's tokens; each resumes from the snapshot the lone
    sequence left at its last full block (40 of 41 tokens) and prefills only the rest."""
    llm = LLM(str(tiny_dir("qwen3_next")), block_size=8, max_num_seqs=4)
    prompt = PROMPTS[2]
    alone = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0]
    pair = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2), use_tqdm=False
    )[0]
    assert [o.token_ids for o in pair.outputs] == [alone.outputs[0].token_ids] * 2
    assert llm.engine.block_manager.snapshots.resumes == 2 and pair.num_cached_tokens == 40
    _assert_pool_free(llm)


def test_sleep_frees_the_state_pool_and_wake_up_brings_it_back(tiny_dir):
    llm = LLM(str(tiny_dir("qwen3_5_moe")), block_size=8, max_num_seqs=2)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = llm.generate(PROMPTS[2], greedy, use_tqdm=False)[0].outputs[0].token_ids
    layer = llm.engine.model.model.layers[0].self_attn
    llm.engine.sleep(1)
    assert layer.delta_state.numel() == layer.conv_state.numel() == 0
    llm.engine.wake_up()
    assert layer.delta_state.shape[0] == 2 + SNAPSHOT_SLOTS and llm.engine.block_manager.states.num_free == 2
    assert llm.generate(PROMPTS[2], greedy, use_tqdm=False)[0].outputs[0].token_ids == before


def test_state_pool_is_counted_as_allocated(tiny_dir):
    llm = LLM(str(tiny_dir("qwen3_next")), block_size=8, max_num_seqs=3)
    cfg = llm.engine.model_config
    held = sum(
        t.numel() * t.element_size()
        for layer in llm.engine.model.model.layers
        for t in (getattr(layer.self_attn, "conv_state", None), getattr(layer.self_attn, "delta_state", None))
        if t is not None
    )
    per_layer = (
        2 * 2 * 16 + 4 * 8
    ) * 3 + 4 * 16 * 8  # conv_dim * (kernel - 1) + value heads * key dim * value dim
    assert state_bytes_per_sequence(cfg) == 3 * per_layer * 4
    assert held == state_pool_bytes(cfg, 3) == (3 + SNAPSHOT_SLOTS) * state_bytes_per_sequence(cfg)
    assert (
        math.prod(llm.engine.model.model.layers[3].self_attn.k_cache.shape[1:]) > 0
    )  # the full layer's cache


def _assert_same_decoding(ours, theirs) -> None:
    """The same tokens, and their logprobs within rounding: a verification's rows go through the projections as
    one product of several rows, decoding's one row each, and these random layers amplify it (transformers' own
    full-sequence and incremental logprobs differ by 8e-5 over 40 tokens of qwen3_next)."""
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
    for a, b in zip(ours, theirs):
        got = [e[t].logprob for e, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]
        want = [e[t].logprob for e, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=3e-4, rtol=0)


def test_ngram_speculation_gives_plain_decodings_tokens(tiny_dir):
    """Runs of up to 9 rows verifying n-gram drafts, most rejected: their rows leave no trace in the states."""
    directory = str(tiny_dir("qwen3_next"))
    ngram = {"method": "ngram", "num_tokens": 8, "prompt_lookup_min": 1}
    spec = LLM(directory, block_size=8, max_num_seqs=4, speculative=ngram)
    plain = LLM(directory, block_size=8, max_num_seqs=4)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    repeating = [PROMPTS[1] * 2, PROMPTS[2]]  # the n-gram lookup finds drafts in them
    _assert_same_decoding(
        spec.generate(repeating, greedy, use_tqdm=False), plain.generate(repeating, greedy, use_tqdm=False)
    )
    stats = spec.engine.stats()
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"] and stats["spec_verifications"] > 0
    _assert_pool_free(spec)


def test_draft_model_speculation_gives_plain_decodings_tokens(tiny_dir):
    """A transformer draft (another family's random weights: most drafts rejected) proposing to a hybrid target;
    n = 2 sampled siblings beside, for the runs that verify a sampled request's drafts."""
    target, draft = str(tiny_dir("qwen3_5_moe")), str(tiny_dir("qwen3"))
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    spec = LLM(
        target, block_size=8, max_num_seqs=4, speculative={"method": "draft", "model": draft, "num_tokens": 3}
    )
    plain = LLM(target, block_size=8, max_num_seqs=4)
    _assert_same_decoding(
        spec.generate(PROMPTS[1:3], greedy, use_tqdm=False),
        plain.generate(PROMPTS[1:3], greedy, use_tqdm=False),
    )
    stats = spec.engine.stats()
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"] and stats["spec_verifications"] > 0
    sampled = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, n=2, seed=3)
    assert all(len(o.token_ids) == 12 for o in spec.generate(PROMPTS[2], sampled, use_tqdm=False)[0].outputs)
    _assert_pool_free(spec)


def test_a_hybrid_draft_model_is_refused(tiny_dir):
    with pytest.raises(ValueError, match="linear-attention layers"):
        LLM(
            str(tiny_dir("qwen3")),
            block_size=8,
            speculative={"method": "draft", "model": str(tiny_dir("qwen3_next"))},
        )


@interpreted_only
def test_the_cuda_path_runs_hybrid_layers(tiny_dir, monkeypatch):
    """The Triton kernels (interpreted) for the gated full-attention layers beside the linear layers' torch code,
    chunked prompts and decodes in one step: the CPU path's greedy tokens."""
    prompts = prompts_of_lengths(3, 21, 40)
    settings = dict(block_size=16, max_num_seqs=4, max_num_batched_tokens=16)
    expected, llm = cpu_tokens_then_emulated(monkeypatch, str(tiny_dir("qwen3_5_moe")), prompts, **settings)
    assert greedy_tokens(llm, prompts) == expected
    _assert_pool_free(llm)


def test_print_memory_need_counts_the_state_pool(tiny_dir, capsys):
    """`serve --print-memory-need`: a hybrid model's cache is its full-attention layers' blocks of one max_model_len
    sequence plus a state slot for each of max_num_seqs and the prefix hits' snapshots."""
    from backend.__main__ import main
    from backend.loader import locate, read_config

    tiny = tiny_dir("qwen3_next")
    assert (
        main(["serve", str(tiny), "--max-model-len", "64", "--max-num-seqs", "3", "--print-memory-need"]) == 0
    )
    model = json.loads(capsys.readouterr().out)["models"][0]
    cfg, _ = read_config(locate(str(tiny)))
    full_layer_blocks = (
        2 * 1 * 4 * 2 * 16 * 16
    )  # K and V, one full layer, 4 blocks of 16 tokens, 2 kv heads of 16
    itemsize = 4 if cfg.torch_dtype in (None, "float32") else 2
    states = (3 + SNAPSHOT_SLOTS) * state_bytes_per_sequence(cfg)
    assert model["kv_cache_bytes"] == full_layer_blocks * itemsize + states


def test_a_multimodal_qwen35_checkpoint_runs_its_text_model(tiny_dir, tmp_path):
    """Qwen3.5's released checkpoints are ForConditionalGeneration: the text model's keys under text_config, its
    tensors under model.language_model., beside a vision tower and a multi-token prediction head we do not run."""
    from safetensors.torch import load_file, save_file

    source = tiny_dir("qwen3_5_moe")
    cfg = json.loads((source / "config.json").read_text())
    wrapped = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": cfg["tie_word_embeddings"],
        "text_config": cfg,
    }
    (tmp_path / "config.json").write_text(json.dumps(wrapped))
    tensors = {
        name.replace("model.", "model.language_model.", 1): t
        for name, t in load_file(str(source / "model.safetensors")).items()
    }
    tensors |= {"model.visual.patch_embed.proj.weight": torch.zeros(4, 4), "mtp.fc.weight": torch.zeros(4, 4)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ours = (
        LLM(str(tmp_path), block_size=8).generate(PROMPTS[2], greedy, use_tqdm=False)[0].outputs[0].token_ids
    )
    plain = (
        LLM(str(source), block_size=8).generate(PROMPTS[2], greedy, use_tqdm=False)[0].outputs[0].token_ids
    )
    assert ours == plain
