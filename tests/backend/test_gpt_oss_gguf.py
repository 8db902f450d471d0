"""gpt-oss GGUF files in llama.cpp's layout (tiny_gguf_gpt_oss.py): MXFP4 blocks decode as gguf-py's dequantize
does, bit for bit; the file reads into gpt-oss's layer kinds; MXFP4 experts stay in their blocks and, like F16 and
F32 experts, decode as transformers' GptOssForCausalLM does on the same weights (greedy tokens identical, logits
and logprobs within 1e-4), past the sliding window, batched, and with n-gram speculation as plain decoding."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from backend import LLM, SamplingParams
from backend.families.gpt_oss_weights import mxfp4_decode
from backend.kernels import native
from backend.loader import locate, read_config
from backend.quant.experts import QuantExperts
from backend.quant.formats import BY_NAME
from backend.quant.formats import dequantize as our_dequantize
from backend.quant.weight_sizes import file_recipe, module_bytes, weight_bytes
from tests.backend.conftest import prompts_of_lengths
from tests.backend.test_gpt_oss import assert_as_transformers, assert_tiny_gpt_oss_layers
from tests.backend.test_models_vs_transformers import assert_matches_transformers
from tests.backend.tiny_gguf_gpt_oss import ggml_mxfp4, random_mxfp4, write_gguf

PROMPTS = prompts_of_lengths(3, 17, 33)  # the window is 12


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root, built = tmp_path_factory.mktemp("gpt-oss-gguf"), {}

    def get(experts: str):
        if experts not in built:
            built[experts] = write_gguf(root, experts)
        return built[experts]

    return get


def test_mxfp4_blocks_decode_as_gguf_py_dequantizes_them():
    """Every code under every E8M0 scale but NaN's, in OpenAI's packing (the HF reader's mxfp4_decode), in GGML's
    blocks as the converter repacks them (gguf-py's dequantize) and as our kernels' decoder reads those: the same
    bits, but for code 8's zero, negative in the spec (and transformers) and positive in GGML's table."""
    blocks = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(1, 1, 16, 16).expand(1, 255, 16, 16)
    scales = torch.arange(255, dtype=torch.uint8).view(1, 255, 1).expand(1, 255, 16).contiguous()
    ours = bits(mxfp4_decode(blocks.contiguous(), scales).numpy())  # [1, 255, 512]
    packed = ggml_mxfp4(blocks.contiguous(), scales)
    # gguf-py's arithmetic (a half scale, doubled values) overflows at the top
    with np.errstate(over="ignore"):
        theirs = np.asarray(dequantize(packed, T.MXFP4), dtype=np.float32)
    finite = np.isfinite(theirs)
    assert np.array_equal(ours[finite], bits(theirs)[finite])
    assert finite[:, :253].all()  # only the two largest scales' largest values overflow there
    kernels = bits(our_dequantize(torch.from_numpy(packed[0]), BY_NAME["MXFP4"], 512).numpy())
    assert np.array_equal(kernels, ours[0])
    blocks, scales = random_mxfp4((2, 8, 64), seed=1)  # and random ones, several experts
    theirs = dequantize(ggml_mxfp4(blocks, scales), T.MXFP4)
    assert np.array_equal(bits(mxfp4_decode(blocks, scales).numpy()), bits(theirs))


def bits(values: np.ndarray) -> np.ndarray:
    """The float32 bits of values, -0 as +0."""
    return (np.asarray(values, dtype=np.float32) + np.float32(0.0)).view(np.int32)


def test_a_gpt_oss_gguf_reads_into_its_layer_kinds(files):
    path, _ = files("MXFP4")
    config, _ = read_config(locate(str(path)))
    assert config.architecture == "GptOssForCausalLM"
    assert_tiny_gpt_oss_layers(config, swiglu_limit=7.0)
    assert config.moe_intermediate_size == 96 and config.rope_scaling["truncate"] is False


@pytest.mark.parametrize("experts", ["MXFP4", "F16", "F32"])
def test_gpt_oss_gguf_decodes_as_transformers(experts, files, hf_model):
    path, ref_dir = files(experts)
    reference = hf_model(ref_dir)
    llm = LLM(str(path), block_size=8)
    moe = llm.engine.model.model.layers[0].mlp
    if experts == "MXFP4":  # kept in the file's blocks, the biases beside them
        assert isinstance(moe.experts, QuantExperts) and moe.experts.gate.fmt.name == "MXFP4"
        assert moe.experts.down.fmt.name == "MXFP4" and moe.w_gate_up_bias is not None
    else:
        assert moe.experts is None
    assert_matches_transformers(llm, reference, PROMPTS, 16)
    outs = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0), use_tqdm=False
    )
    assert_as_transformers(reference, PROMPTS, outs, 16)


def test_gpt_oss_gguf_ngram_speculation_decodes_as_plain_decoding(files):
    path, _ = files("MXFP4")
    prompts = [p * 3 for p in prompts_of_lengths(5, 9)]  # repeats for the n-gram drafts to find
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(path), block_size=8).generate(prompts, greedy, use_tqdm=False)
    spec_llm = LLM(
        str(path), block_size=8, speculative={"method": "ngram", "num_tokens": 3, "prompt_lookup_min": 1}
    )
    spec = spec_llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert spec_llm.engine.stats()["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("experts", ["MXFP4", "F32"])
def test_what_memory_need_counts_is_what_a_gpt_oss_gguf_holds(experts, files, monkeypatch):
    """--print-memory-need and moe_gpu_experts="auto" count the sinks, the router's and the experts' biases, and the
    MXFP4 stacks in their blocks (the biases beside them in F32 do not make them floats)."""
    monkeypatch.setattr(native, "enabled", lambda: False)  # the file's blocks as they are, not our CPU repack
    path, _ = files(experts)
    config, reader = read_config(locate(str(path)))
    llm = LLM(str(path), block_size=8)
    assert module_bytes(llm.engine.model) == weight_bytes(config, file_recipe(reader)).total
