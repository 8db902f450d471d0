"""What `--print-memory-need`, moe_gpu_experts="auto" and the registry count for a model's weights is what a load
holds, in the two cases the counts used to miss: under a bf16 load the norms, biases, attention sinks and the
routers' selection biases are held in bf16 (not fp32), and quantized at load (int8) the layers whose input widths
are not whole 32-weight blocks stay in floats (hf_quantize.replace_layers). The oracle is the loaded model."""

import pytest
import torch

from backend.loader import load_model, locate, read_config
from backend.quant.weight_sizes import kv_b_decode_copies, loaded_recipe, module_bytes, weight_bytes
from tests.backend.tiny_gguf_deepseek import write_gguf as write_deepseek_gguf


def held_and_counted(path, dtype: torch.dtype, quantization: str | None = None) -> tuple[int, int]:
    """(what the loaded model holds but the C decode rows' CPU-only copy of kv_b, what weight_bytes counts)."""
    source = locate(str(path))
    cfg, reader = read_config(source)
    model = load_model(source, cfg, reader, dtype, torch.device("cpu"), 64, quantization=quantization)
    cpu_copy = sum(t.numel() * t.element_size() for t in kv_b_decode_copies(model))
    counted = weight_bytes(cfg, loaded_recipe(reader, quantization, source, dtype)).total
    return module_bytes(model) - cpu_copy, counted


# qwen2: q/k/v biases; gemma3: four norms a layer and q/k norms; gpt_oss: sinks, attention and expert biases;
# deepseek_v3: the latent's norms, q's low-rank norm, the sigmoid router's bias; qwen3_next: the linear layers'
# convolution, dt_bias, A_log and gated norm; olmoe: q/k norms over the whole projection
@pytest.mark.parametrize("family", ["qwen2", "gemma3", "gpt_oss", "deepseek_v3", "qwen3_next", "olmoe"])
def test_a_bf16_load_holds_its_norms_and_biases_in_bf16_as_counted(family, tiny_dir, monkeypatch):
    monkeypatch.setenv("SCRIPTORIUM_QUANT_CPU", "reference")
    held, counted = held_and_counted(tiny_dir(family), torch.bfloat16)
    assert held == counted


def test_a_ggufs_fp32_norms_are_held_and_counted_in_the_compute_dtype(tmp_path, monkeypatch):
    """A deepseek2 file of Q8_0 projections and F32 norms, loaded in bf16."""
    monkeypatch.setenv("SCRIPTORIUM_QUANT_CPU", "reference")
    path, _ = write_deepseek_gguf("deepseek2_v2", tmp_path)
    held, counted = held_and_counted(path, torch.bfloat16)
    assert held == counted


# deepseek_v3: q's low-rank width, the experts' and the shared expert's widths are 24; qwen2_moe: the experts' 48
# and the shared expert's 80
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen2_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_layers_whose_widths_are_not_whole_blocks_stay_in_floats(family, dtype, tiny_dir, monkeypatch):
    monkeypatch.setenv("SCRIPTORIUM_QUANT_CPU", "reference")  # the blocks as stored, not our CPU repack
    held, counted = held_and_counted(tiny_dir(family), dtype, "int8")
    assert held == counted
