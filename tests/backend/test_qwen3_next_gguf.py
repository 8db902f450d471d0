"""qwen3next and qwen35moe GGUF files as llama.cpp's converter writes them (tiny_gguf_qwen3_next.py): greedy tokens
and logprobs against transformers on the same weights, with float tensors and with Q8_0/K-quant ones; the value
heads' tiled order of qwen35moe files read as such."""

import pytest
import torch

from backend import LLM, SamplingParams
from backend.families import qwen3_next
from backend.kernels import native
from backend.loader import locate, read_config
from backend.quant.modules import QuantLinear
from tests.backend.conftest import prompts_of_lengths
from tests.backend.tiny_gguf_qwen3_next import write_gguf

PROMPTS = prompts_of_lengths(1, 23, 41, 70)  # block_size 8, chunks of 12: across blocks, chunks and steps
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root, built = tmp_path_factory.mktemp("qwen3-next-gguf"), {}

    def get(arch: str, quantized: bool = False, legacy: bool = False):
        if (arch, quantized, legacy) not in built:
            built[arch, quantized, legacy] = write_gguf(arch, root, quantized, legacy)
        return built[arch, quantized, legacy]

    return get


def _generate(path) -> list:
    llm = LLM(str(path), block_size=8, max_num_batched_tokens=12, max_num_seqs=4)
    return llm.generate(PROMPTS, GREEDY, use_tqdm=False), llm


def _logprobs(out) -> torch.Tensor:
    tokens = out.outputs[0].token_ids
    return torch.tensor([entry[t].logprob for entry, t in zip(out.outputs[0].logprobs, tokens)])


def _assert_transformers(reference, outputs, rtol: float = 0.0) -> None:
    """Each output's greedy tokens are transformers' argmax at every step, their logprobs its log-softmax."""
    for prompt, out in zip(PROMPTS, outputs):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        assert tokens == logits.argmax(-1).tolist()
        expected = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), torch.tensor(tokens)]
        torch.testing.assert_close(_logprobs(out), expected, atol=1e-4, rtol=rtol)


@pytest.mark.parametrize(
    ("arch", "legacy"), [("qwen3next", False), ("qwen3next", True), ("qwen35moe", False)]
)
def test_float_files_decode_as_transformers(arch, legacy, files, hf_model):
    """Prompts of 1 to 70 tokens in chunks of 12 beside each other's decodes; qwen3next's older ssm_in too."""
    path, ref_dir = files(arch, legacy=legacy)
    reference = hf_model(ref_dir)
    config, _ = read_config(locate(str(path)))
    assert config.architecture == type(reference).__name__
    shape = config.layers[0].attention.linear
    assert (shape.tiled_value_heads, shape.grouped_projections) == (arch == "qwen35moe", False)
    assert [s.attention.kind for s in config.layers] == ["linear"] * 3 + ["full"]
    outputs, _ = _generate(path)
    _assert_transformers(reference, outputs)


def test_tiled_value_heads_are_what_the_qwen35moe_file_holds(files, hf_model, monkeypatch):
    """Read in the checkpoints' order, a qwen35moe file's value heads would meet the wrong key heads."""
    path, ref_dir = files("qwen35moe")
    monkeypatch.setattr(qwen3_next, "TILED_LAYOUTS", ())
    outputs, _ = _generate(path)
    with pytest.raises(AssertionError):
        _assert_transformers(hf_model(ref_dir), outputs)


@pytest.mark.parametrize("arch", ["qwen3next", "qwen35moe"])
def test_quantized_files_decode_as_their_dequantized_weights(arch, files, hf_model, monkeypatch):
    """Q4_K/Q5_K/Q6_K/Q8_0 tensors kept in their blocks (ssm_out's tiled columns included, 32-blocks across 8-wide
    heads): transformers' arithmetic on the weights as they decode, and the C kernels' greedy tokens the same as
    our own decode of those weights in float."""
    path, ref_dir = files(arch, quantized=True)
    outputs, llm = _generate(path)
    attention = llm.engine.model.model.layers[0].self_attn
    assert isinstance(attention.in_proj_qkvz, QuantLinear) and isinstance(attention.out_proj, QuantLinear)
    floats, _ = _generate(ref_dir)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in floats]
    for ours, theirs in zip(outputs, floats):
        torch.testing.assert_close(_logprobs(ours), _logprobs(theirs), atol=0.05, rtol=0)
    # the torch kernels: blocks expanded, exact arithmetic
    monkeypatch.setattr(native, "enabled", lambda: False)
    exact, _ = _generate(path)
    _assert_transformers(hf_model(ref_dir), exact, rtol=1e-4)  # 256 wide: logprobs of a few units
