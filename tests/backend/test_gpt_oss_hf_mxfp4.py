"""A gpt-oss Hugging Face checkpoint whose experts are OpenAI's MXFP4 `*_blocks` / `*_scales` keeps them MXFP4 in
memory (GGML's blocks, which the quantized expert kernels read): as many bytes as the checkpoint's blocks and scales,
the same values, and greedy tokens identical to transformers' with logits and logprobs within 1e-4, on the CPU
kernels and on the CUDA path (Triton, interpreted)."""

import numpy as np
import pytest
import torch

from backend import LLM, SamplingParams
from backend.families.gpt_oss_weights import ggml_mxfp4, mxfp4_decode
from backend.kernels import native
from backend.loader import locate, read_config
from backend.quant.experts import QuantExperts
from backend.quant.formats import BY_NAME
from backend.quant.formats import dequantize as our_dequantize
from backend.quant.weight_sizes import loaded_recipe, module_bytes, weight_bytes
from tests.backend.conftest import interpreted_only, prompts_of_lengths
from tests.backend.cuda_emulation import emulate_cuda
from tests.backend.test_gpt_oss import assert_as_transformers
from tests.backend.test_models_vs_transformers import assert_matches_transformers
from tests.backend.tiny_gguf_gpt_oss import ggml_mxfp4 as converters_mxfp4
from tests.backend.tiny_gguf_gpt_oss import random_mxfp4

PROMPTS = prompts_of_lengths(3, 17, 33)  # the window is 12


@pytest.fixture(scope="module")
def checkpoints(tiny_dir, tmp_path_factory):
    """(the MXFP4 checkpoint, transformers' float checkpoint of the values it decodes to, its blocks and scales)."""
    from safetensors.torch import load_file, save_file

    source = tiny_dir("gpt_oss")
    root = tmp_path_factory.mktemp("gpt-oss-hf-mxfp4")
    tensors = load_file(str(source / "model.safetensors"))
    floats, packed = dict(tensors), dict(tensors)
    names = [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    for seed, name in enumerate(names):
        experts, rows_in, cols_out = tensors[name].shape  # transformers' [E, in, out]
        blocks, scales = random_mxfp4((experts, cols_out, rows_in), seed)
        del packed[name]
        packed.update({f"{name}_blocks": blocks, f"{name}_scales": scales})
        floats[name] = mxfp4_decode(blocks, scales).transpose(1, 2).contiguous()
    dirs = {}
    for label, weights in (("mxfp4", packed), ("floats", floats)):
        directory = dirs[label] = root / label
        directory.mkdir()
        for f in source.iterdir():
            if f.name != "model.safetensors":
                (directory / f.name).write_bytes(f.read_bytes())
        save_file(weights, str(directory / "model.safetensors"))
    stored = {n: t for n, t in packed.items() if n.endswith(("_blocks", "_scales"))}
    return dirs["mxfp4"], dirs["floats"], stored


def test_openai_mxfp4_reencodes_as_the_converter_does_value_for_value():
    """Our re-encoding into GGML's blocks is the converter's (the tests' copy), and our kernels' decoder reads it as
    the OCP MX decoding of the checkpoint's own packing."""
    blocks, scales = random_mxfp4((2, 8, 64), seed=3)
    ours = ggml_mxfp4(blocks, scales)
    assert np.array_equal(ours.numpy(), converters_mxfp4(blocks, scales))
    decoded = our_dequantize(ours.reshape(16, -1), BY_NAME["MXFP4"], 64)
    assert torch.equal(decoded.reshape(2, 8, 64) + 0.0, mxfp4_decode(blocks, scales) + 0.0)  # -0 as +0


def test_mxfp4_experts_stay_mxfp4_and_hold_the_checkpoints_bytes(checkpoints, monkeypatch):
    """Held as the checkpoint's blocks and scales are (17 bytes a 32-value block), not as floats."""
    monkeypatch.setattr(native, "enabled", lambda: False)  # the blocks as loaded, not our CPU repack of them
    packed, _, stored = checkpoints
    model = LLM(str(packed), block_size=8).engine.model
    held = 0
    for layer in model.model.layers:
        experts = layer.mlp.experts
        assert isinstance(experts, QuantExperts)
        assert {w.fmt.name for w in experts.weights()} == {"MXFP4"}
        assert not hasattr(layer.mlp, "w_gate_up") and layer.mlp.w_gate_up_bias is not None
        held += sum(w.data.numel() * w.data.element_size() for w in experts.weights())
    assert held == sum(t.numel() * t.element_size() for t in stored.values())


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_what_memory_need_counts_is_what_an_mxfp4_checkpoint_holds(quantization, checkpoints, monkeypatch):
    """The experts kept MXFP4 are counted in their blocks, beside the rest in floats (or Q8_0 with int8): what
    moe_gpu_experts="auto" and `--print-memory-need --moe-gpu-experts` weigh (weight_sizes.loaded_recipe) is what the
    loaded model holds."""
    monkeypatch.setattr(native, "enabled", lambda: False)  # the blocks as loaded, not our CPU repack of them
    packed, _, stored = checkpoints
    source = locate(str(packed))
    cfg, reader = read_config(source)
    counted = weight_bytes(cfg, loaded_recipe(reader, quantization, source, torch.float32))
    assert (
        module_bytes(LLM(str(packed), block_size=8, quantization=quantization).engine.model) == counted.total
    )
    assert counted.experts == sum(t.numel() * t.element_size() for t in stored.values())  # blocks and scales


def test_mxfp4_checkpoint_decodes_as_transformers(checkpoints, hf_model):
    """The CPU's quantized expert kernels: tokens identical, logits within 1e-4, batched and past the window."""
    packed, floats, _ = checkpoints
    llm = LLM(str(packed), block_size=8)
    moe = llm.engine.model.model.layers[0].mlp
    assert (
        isinstance(moe.experts, QuantExperts) and moe.experts.gate.layout is not None
    )  # repacked for our kernel
    reference = hf_model(floats)
    assert_matches_transformers(llm, reference, PROMPTS, 16)
    outputs = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0), use_tqdm=False
    )
    assert_as_transformers(reference, PROMPTS, outputs, 16)


@interpreted_only
def test_mxfp4_checkpoint_on_the_cuda_path(checkpoints, hf_model, monkeypatch):
    """Triton's MoE kernels (interpreted) read the kept MXFP4 blocks: transformers' greedy tokens."""
    packed, floats, _ = checkpoints
    emulate_cuda(monkeypatch)
    llm = LLM(str(packed), block_size=8)
    assert isinstance(llm.engine.model.model.layers[0].mlp.experts, QuantExperts)
    assert_matches_transformers(llm, hf_model(floats), PROMPTS[:2], 6)
