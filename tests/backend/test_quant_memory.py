"""Memory arithmetic with quantized sizes: Mixtral-8x7B and Qwen3-30B-A3B at Q4_K_M on a 24 GiB card, and the
same functions against what a loaded quantized model holds."""

import pytest
import torch

from backend.config import EngineConfig
from backend.engine.kv_budget import activation_bytes, kv_bytes_per_block, min_kv_bytes
from backend.engine.residency import auto_gpu_experts
from backend.hf_config import from_hf_config
from backend.quant.weight_sizes import file_recipe, fit_gpu_experts, module_bytes, q4_k_m, weight_bytes

GIB = 2**30
MIXTRAL = dict(architectures=["MixtralForCausalLM"], vocab_size=32000, hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
               num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=32768)
QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                 moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                 head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6,
                 rope_theta=1e6, max_position_embeddings=40960)
# What the engine reserves beside weights and the KV cache: activations of a 2k-token prefill, CUDA graphs,
# the CUDA context. Generous for these models (measured activations of Mixtral's 2k-token step: ~0.5 GiB).
RESERVE = GIB + GIB // 2


def kv_cache_bytes(cfg, tokens: int) -> int:
    """The engine's own KV sizing (bf16, blocks of 16)."""
    return tokens // 16 * kv_bytes_per_block(cfg, 16, torch.bfloat16)


def test_mixtral_8x7b_q4_k_m_fits_24_gib_with_experts_offloaded():
    cfg = from_hf_config(MIXTRAL, "mixtral")
    w = weight_bytes(cfg, q4_k_m)
    # llama.cpp's current recipe: 28.4 GB (TheBloke's 2023 file, ffn_down all Q4_K: 26.4 GB); 93 GB in bf16
    assert 28.0e9 < w.total < 28.8e9
    assert w.per_expert[0] == 3 * 4096 * 14336 * 144 // 256 + 4096 * 14336 * (210 - 144) // 256  # Q6_K down
    assert w.per_expert[4] == 3 * 4096 * 14336 * 144 // 256  # a layer whose ffn_down stays Q4_K
    kv = kv_cache_bytes(cfg, 4096)
    assert kv == 512 * 2**20  # 32 layers, 8 kv heads of 128, bf16
    budget = 24 * GIB
    assert w.total + kv + RESERVE > budget  # it does not fit whole
    n = fit_gpu_experts(w, budget, kv + RESERVE, cfg.num_experts)
    assert n == 6
    assert w.resident(6) + kv + RESERVE <= budget < w.resident(7) + kv + RESERVE
    offloaded = w.total - w.resident(6)
    assert 6.5e9 < offloaded < 7.5e9  # in host memory, still quantized (a quarter of the bf16 copy)


def test_the_engines_auto_choice_for_mixtral_on_24_gib_agrees():
    """What LLM(..., moe_gpu_experts="auto", max_model_len=4096) reserves on a 24 GiB budget: its activation
    estimate for a 2k-token step plus a 4k-token KV cache; it picks the same 6 experts per layer."""
    cfg = from_hf_config(MIXTRAL, "mixtral")
    config = EngineConfig(model="mixtral", max_model_len=4096, moe_gpu_experts="auto")
    reserved = activation_bytes(cfg, 2048, 64, torch.bfloat16) + \
        min_kv_bytes(config, kv_bytes_per_block(cfg, 16, torch.bfloat16), 4096)
    assert GIB // 2 < reserved < RESERVE
    assert auto_gpu_experts(config, cfg, weight_bytes(cfg, q4_k_m), 24 * GIB, reserved) == 6


def test_qwen3_30b_a3b_q4_k_m_fits_24_gib_whole():
    cfg = from_hf_config(QWEN3_MOE, "qwen3-moe")
    w = weight_bytes(cfg, q4_k_m)
    assert 18.3e9 < w.total < 18.8e9  # the published Q4_K_M file: 18.6 GB
    kv = kv_cache_bytes(cfg, 4096)
    assert kv == 384 * 2**20
    assert fit_gpu_experts(w, 24 * GIB, kv + RESERVE, cfg.num_experts) is None
    assert w.total + kv + RESERVE <= 24 * GIB
    assert w.per_expert[0] == 2 * 2048 * 768 * 144 // 256 + 2048 * 768 * 210 // 256


def test_a_budget_below_one_expert_per_layer_is_refused():
    cfg = from_hf_config(MIXTRAL, "mixtral")
    with pytest.raises(ValueError, match="with one expert per layer resident"):
        fit_gpu_experts(weight_bytes(cfg, q4_k_m), 4 * GIB, GIB, cfg.num_experts)


@pytest.mark.parametrize("family", ["qwen2_moe", "llama3_rope_tied", "phi3"])
def test_the_arithmetic_is_what_a_loaded_model_holds(family, tiny_gguf, monkeypatch):
    """On the device path the blocks are the file's bytes: weight_bytes over the file's formats is exact."""
    from backend.loader import load_model, locate, read_config

    monkeypatch.setenv("SCRIPTORIUM_QUANT_CPU", "reference")  # unpacked: the CUDA layout
    path, _ = tiny_gguf(family)
    source = locate(str(path))
    cfg, reader = read_config(source)
    model = load_model(source, cfg, reader, torch.float32, torch.device("cpu"), 64)
    predicted = weight_bytes(cfg, file_recipe(reader))
    assert module_bytes(model) == predicted.total
    offloaded = load_model(source, cfg, reader, torch.float32, torch.device("cpu"), 64, moe_gpu_experts=1) \
        if cfg.is_moe else None
    if offloaded is not None:
        assert module_bytes(offloaded) == predicted.resident(1)


def test_a_whole_quantized_tensor_is_the_files_mapped_bytes_not_a_copy(tiny_gguf, monkeypatch):
    """A weight that is one whole tensor of the file (an expert stack, an attention output) points into the file's
    read-only memory map: loading copies none of it into anonymous memory (a 26 GB Mixtral is never held twice on
    its way to the device, the repack or the offloaded experts). Fused shards (q|k|v) are assembled in a copy."""
    import numpy as np

    from backend.loader import load_model, locate, read_config

    monkeypatch.setenv("SCRIPTORIUM_QUANT_CPU", "reference")  # the blocks kept as they are
    path, _ = tiny_gguf("mixtral")
    source = locate(str(path))
    cfg, reader = read_config(source)
    model = load_model(source, cfg, reader, torch.float32, torch.device("cpu"), 64)
    mapped = {t.name: np.asarray(t.data).ctypes.data for t in reader.tensors}
    layer = model.model.layers[0]
    assert layer.mlp.experts.gate.data.data_ptr() == mapped["blk.0.ffn_gate_exps.weight"]
    assert layer.mlp.experts.down.data.data_ptr() == mapped["blk.0.ffn_down_exps.weight"]
    assert layer.self_attn.o_proj.parts[0].data.data_ptr() == mapped["blk.0.attn_output.weight"]
    assert layer.self_attn.qkv_proj.parts[0].data.data_ptr() not in mapped.values()


def test_random_q4_k_weights_hold_what_the_arithmetic_says(tmp_path, monkeypatch):
    """bench/device.py's quantized figure: a Mixtral-shaped config marked "Q4_K" loads random, finite Q4_K blocks
    in every linear layer and expert, and holds the bytes weight_bytes predicts for that recipe."""
    import json

    from backend.loader import ModelLoadError, load_model, locate, read_config
    from backend.quant.modules import QuantWeight

    monkeypatch.setenv("SCRIPTORIUM_QUANT_CPU", "reference")
    shape = dict(MIXTRAL, vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    (tmp_path / "config.json").write_text(json.dumps({**shape, "scriptorium_random_weights": "Q4_K"}))
    source = locate(str(tmp_path))
    cfg, _ = read_config(source)
    model = load_model(source, cfg, None, torch.float32, torch.device("cpu"), 64)
    weights = [m for m in model.modules() if isinstance(m, QuantWeight)]
    assert len(weights) == 2 * (3 + 2)  # per layer: qkv, o and the experts' gate, up, down
    assert all(w.fmt.name == "Q4_K" and torch.isfinite(w.dequantize(torch.float32)).all() for w in weights)
    recipe = lambda kind, layer, c: "F32" if kind in ("token_embd", "output", "ffn_gate_inp") else "Q4_K"  # noqa: E731
    assert module_bytes(model) == weight_bytes(cfg, recipe).total
    (tmp_path / "config.json").write_text(json.dumps({**shape, "scriptorium_random_weights": "Q4_X"}))
    with pytest.raises(ModelLoadError, match="scriptorium_random_weights='Q4_X' is not a format we compute on"):
        locate(str(tmp_path))
