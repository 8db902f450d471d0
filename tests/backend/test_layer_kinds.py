"""Each layer's kinds (backend/layer_spec.py) as the config readers build them, and the layers that differ by
kind: SmolLM3's NoPE layers (with sliding windows on some) and Phi's partial rotary, against transformers, in the
module path and in the CPU's one-call decode step."""

import json

import pytest
import torch

from backend import LLM, SamplingParams
from backend.config import EngineConfig
from backend.engine.llm_engine import LLMEngine
from backend.gguf_config import gguf_config
from backend.hf_config import from_hf_config
from backend.kernels import native
from backend.layer_spec import AttentionSpec, LayerSpec, MLPSpec
from tests.backend.conftest import interpreted_only, prompts_of_lengths
from tests.backend.cuda_emulation import emulate_cuda
from tests.backend.test_cpu_decoder import assert_one_call_is_the_modules, one_call_engine
from tests.backend.test_models_vs_transformers import PROMPTS, prefill_logits
from tests.backend.tiny_gguf import build_family


def hf_config(tiny_dir, family: str) -> dict:
    return json.loads((tiny_dir(family) / "config.json").read_text())


def kinds(cfg) -> list[tuple]:
    return [
        (s.attention.kind, s.attention.window, s.attention.rope, s.attention.qk_norm, s.mlp.kind)
        for s in cfg.layers
    ]


def test_each_family_reads_into_per_layer_kinds(tiny_dir):
    mistral = from_hf_config(hf_config(tiny_dir, "mistral"), "mistral")
    assert kinds(mistral) == [("sliding", 24, True, None, "dense")] * 2
    qwen3 = from_hf_config(hf_config(tiny_dir, "qwen3"), "qwen3")
    assert kinds(qwen3) == [("full", None, True, "head", "dense")] * 2
    # Qwen2-MoE: mlp_only_layers and decoder_sparse_step say which layers are sparse
    cfg = hf_config(tiny_dir, "qwen2_moe")
    assert [s.mlp for s in from_hf_config(cfg, "q").layers] == [MLPSpec("moe", "softmax_topk"), MLPSpec()]
    stepped = from_hf_config(
        {**cfg, "num_hidden_layers": 4, "mlp_only_layers": [], "decoder_sparse_step": 2}, "q"
    )
    assert [s.mlp.kind for s in stepped.layers] == ["dense", "moe", "dense", "moe"]
    # SmolLM3: every fourth layer NoPE by default, or the list config.json gives; windows where layer_types say
    smol = from_hf_config(hf_config(tiny_dir, "smollm3"), "smollm3")
    assert [s.attention.rope for s in smol.layers] == [True, True, True, False]
    windows = from_hf_config(hf_config(tiny_dir, "smollm3_nope_windows"), "smollm3")
    assert kinds(windows) == [
        ("sliding", 12, False, None, "dense"),
        ("full", None, True, None, "dense"),
        ("sliding", 12, False, None, "dense"),
    ]
    # Phi-3: one window for every layer (or none, Phi-4); the rotating part of each head
    phi3, phi4 = (from_hf_config(hf_config(tiny_dir, f), f) for f in ("phi3", "phi4_partial_rotary"))
    assert (
        kinds(phi3) == [("sliding", 24, True, None, "dense")] * 2 and phi3.rotary_dim == phi3.head_dim == 16
    )
    assert kinds(phi4) == [("full", None, True, None, "dense")] * 2 and phi4.rotary_dim == 8


def test_smollm3_gguf_layers_rotate_as_llama_cpp_says(tiny_gguf):
    """No key in the file: llama.cpp's smollm3 graph skips rotary where (layer + 1) % 4 == 0."""
    path, _ = tiny_gguf("smollm3")
    cfg, _ = gguf_config(path)
    assert cfg.architecture == "SmolLM3ForCausalLM"
    assert [s.attention.rope for s in cfg.layers] == [True, True, True, False]


def test_a_layer_spec_refuses_what_it_cannot_be():
    with pytest.raises(ValueError, match="only sliding attention has a window"):
        AttentionSpec("full", window=8)
    with pytest.raises(ValueError, match="attention kind 'mamba' is not one of full, sliding, mla, linear"):
        AttentionSpec("mamba")
    with pytest.raises(ValueError, match="an mla layer has its MLAShape"):
        AttentionSpec("mla")
    with pytest.raises(ValueError, match="a MoE layer names one of softmax_topk"):
        MLPSpec("moe")
    assert LayerSpec(AttentionSpec(), MLPSpec()) == LayerSpec(AttentionSpec("full"), MLPSpec("dense"))


def test_nope_layers_are_what_makes_smollm3_match(tiny_dir, hf_model):
    """Our logits equal transformers' SmolLM3 (its fourth layer unrotated) and are far from the same weights with
    every layer rotated: the NoPE layer is what the match holds to."""
    from transformers import AutoModelForCausalLM, SmolLM3Config

    directory = tiny_dir("smollm3")
    reference = hf_model(directory)
    config = SmolLM3Config.from_pretrained(str(directory), no_rope_layers=[1, 1, 1, 1])
    rotated = AutoModelForCausalLM.from_pretrained(str(directory), config=config, dtype=torch.float32).eval()
    llm = LLM(str(directory), block_size=8)
    for prompt, ours in zip(PROMPTS, prefill_logits(llm, PROMPTS)):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0]
            all_rotated = rotated(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
        if len(prompt) > 1:  # the first position has no relative offset to rotate
            assert (ours - all_rotated).abs().max() > 1e-2


@pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")
def test_the_one_call_step_keeps_nope_layers_and_each_layers_window(tmp_path):
    """SmolLM3 quantized at load, NoPE layers with a 12-token window beside a rotated full-attention layer: the C
    loop's rows past the window are the modules' bits (a loop that rotated every layer, or used one window for
    all, would not be)."""
    directory = build_family("smollm3_nope_windows", tmp_path / "smol")
    engine = one_call_engine(directory)
    assert engine.runner.cpu_decoder is not None
    assert [layer.self_attn.rope for layer in engine.model.model.layers] == [False, True, False]
    assert_one_call_is_the_modules(engine)


@pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")
def test_partial_rotary_runs_in_the_one_call_step(tiny_gguf):
    """Phi-4-mini's half-rotated heads: the C loop rotates each head's leading half and keeps the rest, the
    modules' bits (the modules match transformers: test_gguf_layouts)."""
    path, _ = tiny_gguf("phi4_partial_rotary")
    engine = LLMEngine(EngineConfig(model=str(path), block_size=8, max_model_len=128,
                                    speculative={"method": "ngram", "num_tokens": 3}))
    assert engine.model_config.rotary_dim * 2 == engine.model_config.head_dim
    assert engine.runner.cpu_decoder is not None and engine.runner.cpu_decoder.shape.rotary_dim == engine.model_config.rotary_dim
    assert_one_call_is_the_modules(engine)


@interpreted_only
@pytest.mark.parametrize("family", ["smollm3_nope_windows", "phi4_partial_rotary", "gemma3", "gpt_oss"])
def test_the_cuda_path_computes_each_layers_kind(family, tiny_dir, monkeypatch):
    """The Triton kernels (interpreted) on NoPE layers with their windows, on half-rotated heads, on Gemma 3's
    windows, per-layer bases and (1 + w) norms, and on gpt-oss's sinks on windowed and full layers (its experts'
    biases and clamped SwiGLU in the torch loop there): the CPU path's greedy tokens, on prompts longer than the
    window."""
    directory, settings = str(tiny_dir(family)), dict(block_size=16, max_num_seqs=4, max_model_len=256)
    prompts = prompts_of_lengths(3, 21, 40)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids for o in LLM(directory, **settings).generate(prompts, greedy, use_tqdm=False)
    ]
    emulate_cuda(monkeypatch)
    outputs = LLM(directory, **settings).generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
