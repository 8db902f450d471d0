"""What `--print-memory-need`, moe_gpu_experts="auto" and the multi-model registry count for a model's weights is
what the loaded model holds: hybrid models' linear-attention layers (their projections in the file's formats and
their small float tensors), and the copy of a latent attention layer's kv_b that our C decode rows read, which is
made at load so that it is counted from the start. The oracle is the loaded model itself."""

import pytest
import torch

from backend import LLM, SamplingParams
from backend.kernels import native
from backend.loader import load_model, locate, read_config
from backend.quant.weight_sizes import file_recipe, loaded_recipe, module_bytes, weight_bytes
from backend.server.registry import engine_bytes
from tests.backend.conftest import prompts_of_lengths
from tests.backend.tiny_gguf_deepseek import write_gguf as write_deepseek_gguf
from tests.backend.tiny_gguf_qwen3_next import write_gguf as write_hybrid_gguf
from tests.backend.tiny_models import build_model


def _loaded(path, quantization=None):
    """The model as load_model holds it, its quantized blocks as stored (the layout the GPU reads)."""
    source = locate(str(path))
    cfg, reader = read_config(source)
    model = load_model(source, cfg, reader, torch.float32, torch.device("cpu"), 64, quantization=quantization)
    return source, cfg, reader, model


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_hybrid_checkpoint_holds_what_is_counted(family, quantization, tiny_dir, tmp_path, monkeypatch):
    """Linear layers' q|k|v|z, b|a and output projections (quantized at load with int8), their convolution,
    dt_bias, A_log and gated norm; the full layers' q projection with its output gate's rows."""
    monkeypatch.setenv("SCRIPTORIUM_QUANT_CPU", "reference")  # blocks as stored, not our CPU repack of them
    # int8: every width whole 32-blocks (hf_quantize keeps a layer of narrower rows in floats, as no recipe says)
    directory = (
        build_model(family, tmp_path, shared_expert_intermediate_size=64)
        if quantization
        else tiny_dir(family)
    )
    source, cfg, reader, model = _loaded(directory, quantization)
    assert {spec.attention.kind for spec in cfg.layers} == {"linear", "full"}
    recipe = loaded_recipe(reader, quantization, source, torch.float32)
    assert module_bytes(model) == weight_bytes(cfg, recipe).total


@pytest.mark.parametrize(
    ("arch", "legacy"), [("qwen3next", False), ("qwen3next", True), ("qwen35moe", False)]
)
def test_a_hybrid_gguf_holds_what_is_counted(arch, legacy, tmp_path, monkeypatch):
    """K-quant and Q8_0 files in llama.cpp's layouts: attn_qkv and attn_gate (or an older file's fused ssm_in),
    ssm_ba (or ssm_beta and ssm_alpha), ssm_out, with the full layers beside them."""
    monkeypatch.setenv("SCRIPTORIUM_QUANT_CPU", "reference")
    path, _ = write_hybrid_gguf(arch, tmp_path, quantized=True, legacy=legacy)
    _, cfg, reader, model = _loaded(path)
    assert module_bytes(model) == weight_bytes(cfg, file_recipe(reader)).total


def _int8_blocks(rows: int, cols: int) -> int:
    """An int8 matrix with an fp32 scale for each 32 columns (mla_attention.BLOCK), as cpu_mla.c reads it."""
    return rows * cols + rows * (cols // 32) * 4


def _params_and_buffers(model) -> int:
    tensors = {t.data_ptr(): t for t in model.parameters()}
    tensors |= {t.data_ptr(): t for name, t in model.named_buffers() if not name.endswith("cos_sin")}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.skipif(not native.enabled(), reason="needs our C kernels (a C compiler)")
@pytest.mark.parametrize("split", [True, False])
def test_the_latent_attentions_copy_of_kv_b_is_held_and_counted_from_the_load(split, tmp_path):
    """A deepseek2 file's kv_b as the C decode rows read it: W_UK [heads, lora, nope] and W_UV [heads, v, lora], int8
    with a scale a block where that holds them exactly (the split layout's Q8_0 attn_k_b and attn_v_b; of one
    attn_kv_b only W_UV, W_UK then an fp32 copy). Made at load, counted in module_bytes and by the registry, and
    the very tensors the decode steps read."""
    path, _ = write_deepseek_gguf("deepseek2_v2", tmp_path, split)
    llm = LLM(str(path), block_size=8)
    model, cfg = llm.engine.model, llm.engine.model_config
    mla = cfg.layers[0].attention.mla
    heads, lora, nope, v = cfg.num_heads, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.v_head_dim
    uk = _int8_blocks(heads * lora, nope) if split else heads * lora * nope * 4
    copy = cfg.num_layers * (uk + _int8_blocks(heads * v, lora))
    layers = [layer.self_attn for layer in model.model.layers]
    made = [(a.head_weights.uk, a.head_weights.uv) for a in layers]
    assert all(a.head_weights.source == a.kv_b_proj.weight.data_ptr() for a in layers)
    assert module_bytes(model) == _params_and_buffers(model) + copy
    cache = sum(t.numel() * t.element_size() for a in layers for t in (a.k_cache, a.v_cache))
    tables = sum(
        t.numel() * t.element_size() for name, t in model.named_buffers() if name.endswith("cos_sin")
    )
    assert engine_bytes(llm.engine) == _params_and_buffers(model) + tables + copy + cache
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate(prompts_of_lengths(3, 17), greedy, use_tqdm=False)
    assert all(
        a.head_weights.uk is uk and a.head_weights.uv is uv for a, (uk, uv) in zip(layers, made)
    )  # as made
    assert module_bytes(model) == _params_and_buffers(model) + copy
