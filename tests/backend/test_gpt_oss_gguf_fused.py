"""gpt-oss GGUF files whose gate and up experts are one `ffn_gate_up_exps` stack (llama.cpp's converter with
fuse_gate_up_exps: each expert's gate rows, then its up rows; the bias likewise), written with gguf-py
(tiny_gguf_gpt_oss.py): MXFP4 stays in its blocks, and MXFP4 and F32 decode as transformers does (greedy tokens
identical, logprobs within 1e-4) and as the split file of the same model does; the memory need counts it as held."""

import pytest
import torch

from backend import LLM, SamplingParams
from backend.kernels import native
from backend.loader import locate, read_config
from backend.quant.experts import QuantExperts
from backend.quant.weight_sizes import file_recipe, module_bytes, weight_bytes
from tests.backend.conftest import prompts_of_lengths
from tests.backend.test_gpt_oss import assert_as_transformers
from tests.backend.test_models_vs_transformers import prefill_logits
from tests.backend.tiny_gguf_gpt_oss import write_gguf

PROMPTS = prompts_of_lengths(3, 17, 33)  # the window is 12


@pytest.mark.parametrize("experts", ["MXFP4", "F32"])
def test_a_fused_gate_up_gguf_decodes_as_transformers(experts, tmp_path, hf_model):
    path, ref_dir = write_gguf(tmp_path, experts, fused=True)
    llm = LLM(str(path), block_size=8)
    moe = llm.engine.model.model.layers[0].mlp
    if experts == "MXFP4":
        assert isinstance(moe.experts, QuantExperts)
        assert {w.fmt.name for w in moe.experts.weights()} == {"MXFP4"}
    split, _ = write_gguf(tmp_path, experts)
    for fused_logits, split_logits in zip(
        prefill_logits(llm, PROMPTS), prefill_logits(LLM(str(split), block_size=8), PROMPTS)
    ):
        assert torch.equal(fused_logits, split_logits)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    assert_as_transformers(hf_model(ref_dir), PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False), 16)


def test_what_memory_need_counts_is_what_a_fused_file_holds(tmp_path, monkeypatch):
    """--print-memory-need counts the fused stack's gate and up halves in its MXFP4 blocks, as they are held."""
    monkeypatch.setattr(native, "enabled", lambda: False)  # the file's blocks as they are, not our CPU repack
    path, _ = write_gguf(tmp_path, "MXFP4", layers=2, fused=True)
    config, reader = read_config(locate(str(path)))
    llm = LLM(str(path), block_size=8)
    assert module_bytes(llm.engine.model) == weight_bytes(config, file_recipe(reader)).total
