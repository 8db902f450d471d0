"""Every GGUF layout we run, from tiny files written as llama.cpp lays them out (tests/backend/tiny_gguf.py):
logits and greedy tokens against transformers on the same weights, tokenizer and chat template from the
file's metadata, quantized experts offloaded, and each refusal's message."""

import logging

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter

from backend import LLM, SamplingParams
from backend.kernels import native
from backend.loader import ModelLoadError, load_model, locate, read_config
from backend.models.moe import SparseMoE
from backend.quant.modules import QuantEmbedding, QuantLinear
from tests.backend.conftest import hf_greedy, prompts_of_lengths
from tests.backend.hf_gguf import transformers_model
from tests.backend.test_models_vs_transformers import prefill_logits
from tests.backend.tiny_gguf import POLICY

PROMPTS = prompts_of_lengths(3, 17, 33)


@pytest.fixture
def exact_kernels(monkeypatch):
    """The CPU's torch path (dequantize + fp32 matmul, PyTorch's norm, rotary and attention): transformers' own
    arithmetic. Our C kernels differ only in summation order, but these tiny random models attend so sharply that
    it shows (up to 5e-4 in the logits); the layouts are what these tests are about."""
    monkeypatch.setattr(native, "enabled", lambda: False)


@pytest.mark.parametrize("family", list(POLICY))
def test_every_layout_matches_transformers(family, tiny_gguf, hf_model, exact_kernels):
    path, ref_dir = tiny_gguf(family)
    reference = hf_model(ref_dir)
    llm = LLM(str(path), block_size=8)
    model = llm.engine.model
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, QuantLinear)
    assert isinstance(model.model.embed_tokens, QuantEmbedding) == (POLICY[family]["token_embd"] != "F16")
    if "exps" in " ".join(POLICY[family]):
        assert any(isinstance(m, SparseMoE) and m.experts is not None for m in model.modules())

    for prompt, ours in zip(PROMPTS, prefill_logits(llm, PROMPTS)):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 32)

    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(str(ref_dir))
    text = "The scribe copied the manuscript, line after line."
    assert llm.tokenizer(text).input_ids == theirs(text).input_ids
    messages = [{"role": "user", "content": "Who mixed the ink?"}]
    assert llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt == \
        theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# transformers' GGUF reader takes a qwen2moe file's expert sizes from Qwen2MoeConfig's defaults, and every layer
# as sparse: the variant it can read.
QWEN2_MOE_DEFAULTS = {"mlp_only_layers": [], "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632}


@pytest.mark.parametrize("family,variant,build", [
    ("llama", None, None),  # q/k rows permuted by the converter
    ("qwen2_moe", "defaults", QWEN2_MOE_DEFAULTS),  # stacked experts, the shared expert and its vector gate
])
def test_transformers_reads_our_files_as_we_do(family, variant, build, tiny_gguf, hf_model):
    """The writer follows llama.cpp's conventions: transformers' own GGUF loader gets the same model."""
    path, ref_dir = tiny_gguf(family, variant, build)
    theirs = transformers_model(path)
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, hf_model(ref_dir)(ids).logits, atol=1e-4, rtol=1e-4)


def test_older_mixtral_files_with_one_tensor_per_expert(tiny_gguf, hf_model, exact_kernels):
    path, ref_dir = tiny_gguf("mixtral", "legacy", legacy_experts=True)
    llm = LLM(str(path), block_size=8)
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf_model(ref_dir), PROMPTS[1], 16)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_offloaded_quantized_experts_give_identical_tokens(family, tiny_gguf):
    path, _ = tiny_gguf(family)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    resident = LLM(str(path), block_size=8)
    expected = [o.outputs[0].token_ids for o in resident.generate(PROMPTS, params, use_tqdm=False)]
    offloaded = LLM(str(path), block_size=8, moe_gpu_experts=2)  # 2 of 4 experts per layer
    assert [o.outputs[0].token_ids for o in offloaded.generate(PROMPTS, params, use_tqdm=False)] == expected
    caches = [m.expert_cache for m in offloaded.engine.model.modules() if isinstance(m, SparseMoE) and m.expert_cache]
    assert caches and all(c.misses > 0 for c in caches)
    # Host memory holds the experts repacked, not expanded: codes (uint8) and scales' bits (fp16 or fp32 ones).
    assert {t.dtype for c in caches for t in c.host} <= {torch.uint8, torch.int16, torch.int32}
    inter, hidden = resident.engine.model_config.moe_intermediate_size, resident.engine.model_config.hidden_size
    assert caches[0].host_bytes() < 4 * 3 * inter * hidden * 4 / 2  # under half of fp32 (~0.3 at these formats)


def test_types_without_a_kernel_are_dequantized_at_load_with_one_line(tiny_gguf, caplog, monkeypatch):
    """A type gguf-py reads that no kernel of ours takes (NVFP4) is expanded at load, on the CPU and where the Triton
    kernels run (their interpreter here, as on CUDA) alike, with one line saying what that costs; the file's other
    quantized tensors stay in their blocks (TQ2_0 too, which every kernel reads)."""
    path, _ = tiny_gguf("mistral", "nvfp4", policy={**POLICY["mistral"], "ffn_down": "NVFP4", "ffn_up": "TQ2_0"})
    source = locate(str(path))
    cfg, reader = read_config(source)
    weights = cfg.num_layers * cfg.hidden_size * cfg.intermediate_size
    held, in_file = weights * 4 / 2**30, weights // 64 * 36 / 2**30  # fp32 against NVFP4's 36 bytes per 64 weights
    for triton in (False, True):
        if triton:
            monkeypatch.setenv("SCRIPTORIUM_TRITON", "1")
            monkeypatch.setenv("TRITON_INTERPRET", "1")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="backend.quant"):
            model = load_model(source, cfg, reader, torch.float32, torch.device("cpu"), 64)
        lines = [r.getMessage() for r in caplog.records if "kernels do not take" in r.getMessage()]
        assert len(lines) == 1 and "NVFP4" in lines[0] and "dequantized at load to float32" in lines[0]
        assert f"{held:.3f} GiB in memory where the file holds {in_file:.3f} GiB ({held - in_file:.3f} GiB more)" \
            in lines[0]
        assert not isinstance(model.model.layers[0].mlp.down_proj, QuantLinear)
        assert [p.fmt.name for p in model.model.layers[0].mlp.gate_up_proj.parts] == ["Q5_0", "TQ2_0"]


# Refusals ------------------------------------------------------------------------------------------------

def minimal_gguf(path, arch="llama", extra=None, tensors=None):
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_context_length(64)
    for key, value in (extra or {}).items():
        w.add_uint32(key, value) if isinstance(value, int) else w.add_string(key, value)
    w.add_tensor("token_embd.weight", torch.zeros(16, 32).numpy())
    for name, (data, qtype) in (tensors or {}).items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def refusal(path) -> str:
    with pytest.raises(ModelLoadError) as e:
        source = locate(str(path))
        config, reader = read_config(source)
        load_model(source, config, reader, torch.float32, torch.device("cpu"), 64)
    return str(e.value)


def test_a_layout_we_do_not_run_is_refused_with_what_is_supported(tmp_path):
    msg = refusal(minimal_gguf(tmp_path / "g.gguf", arch="gemma2"))
    assert msg.startswith(f"{tmp_path / 'g.gguf'}: GGUF layout 'gemma2' is not supported; supported layouts: llama")
    assert "qwen3moe" in msg


def test_a_tensor_type_we_cannot_read_is_refused_with_what_is_supported(tmp_path):
    q8_1 = torch.zeros(32, 40, dtype=torch.uint8).numpy()  # Q8_1: an intermediate type, no dequantizer
    msg = refusal(minimal_gguf(tmp_path / "t.gguf", tensors={"blk.0.attn_q.weight": (q8_1, T.Q8_1)}))
    assert f"{tmp_path / 't.gguf'}: GGUF tensor type Q8_1 is not supported; supported: F32, F16, BF16 (floats), Q4_0" in msg
    assert "Q6_K" in msg and "IQ3_XXS" in msg and "MXFP4" in msg and "(kept quantized)" in msg


def test_a_tensor_the_layout_does_not_have_is_refused(tmp_path):
    qkv = (torch.zeros(96, 32).numpy(), None)
    msg = refusal(minimal_gguf(tmp_path / "n.gguf", tensors={"blk.0.attn_qkv.weight": qkv}))
    assert "GGUF tensor 'blk.0.attn_qkv.weight' is not one this layout uses" in msg


def test_rope_scaling_and_layout_refusals(tmp_path):
    assert "GGUF rope scaling 'longrope' is not supported" in refusal(
        minimal_gguf(tmp_path / "y.gguf", extra={"llama.rope.scaling.type": "longrope"}))
    assert "without llama.rope.scaling.factor" in refusal(
        minimal_gguf(tmp_path / "f.gguf", extra={"llama.rope.scaling.type": "yarn"}))
    assert "partial rotary embeddings (8 of 16 dimensions)" in refusal(
        minimal_gguf(tmp_path / "p.gguf", extra={"llama.rope.dimension_count": 8}))
    assert "a qwen2moe GGUF needs qwen2moe.expert_count" in refusal(minimal_gguf(tmp_path / "m.gguf", "qwen2moe"))
