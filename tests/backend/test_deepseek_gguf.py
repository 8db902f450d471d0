"""deepseek2 (both of llama.cpp's kv_b layouts) and glm4moe GGUF files, K-quants and Q8_0 (tiny_gguf_deepseek.py):
logits and greedy tokens against transformers on the weights as the file decodes them."""

import json

import pytest
import torch

from backend import LLM, SamplingParams
from backend.hf_config import from_hf_config
from backend.kernels import native
from backend.loader import locate, read_config
from backend.quant.modules import QuantLinear
from backend.quant.weight_sizes import file_recipe, module_bytes, weight_bytes
from tests.backend.conftest import prompts_of_lengths
from tests.backend.test_models_vs_transformers import assert_matches_transformers
from tests.backend.tiny_gguf_deepseek import write_gguf

PROMPTS = prompts_of_lengths(3, 17, 33)
CASES = [
    ("deepseek2_v2", True),
    ("deepseek2_v2", False),
    ("deepseek2_v2_grouped", True),
    ("deepseek2_v3", True),
    ("glm4moe", True),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root, built = tmp_path_factory.mktemp("deepseek-gguf"), {}

    def get(variant: str, split: bool):
        if (variant, split) not in built:
            built[variant, split] = write_gguf(variant, root, split)
        return built[variant, split]

    return get


@pytest.mark.parametrize(("variant", "split"), CASES)
def test_deepseek2_and_glm4moe_files_match_transformers(variant, split, files, hf_model, monkeypatch):
    monkeypatch.setattr(native, "enabled", lambda: False)  # transformers' arithmetic (test_gguf_layouts.py)
    path, ref_dir = files(variant, split)
    config, reader = read_config(locate(str(path)))
    reference = hf_model(ref_dir)
    assert config.architecture == type(reference).__name__
    assert config.num_layers == reference.config.num_hidden_layers  # glm4moe's MTP layer left out
    # the routers (group-limited or not, sigmoid or softmax, their groups and scale) and the leading dense layers
    hf = from_hf_config(json.loads((ref_dir / "config.json").read_text()), str(ref_dir))
    assert [layer.mlp for layer in config.layers] == [layer.mlp for layer in hf.layers]
    assert config.norm_topk_prob == hf.norm_topk_prob
    llm = LLM(str(path), block_size=8)
    # what --print-memory-need and moe_gpu_experts="auto" count is what the model holds
    assert module_bytes(llm.engine.model) == weight_bytes(config, file_recipe(reader)).total
    attn = llm.engine.model.model.layers[1].self_attn
    if variant != "glm4moe":
        assert isinstance(attn.kv_a_proj_with_mqa, QuantLinear)
        assert not isinstance(attn.kv_b_proj, QuantLinear)  # attn_kv_b, or its split halves, as floats
    assert_matches_transformers(llm, reference, PROMPTS, 16)


@pytest.mark.skipif(not native.enabled(), reason="needs our C kernels (a C compiler)")
@pytest.mark.parametrize(("variant", "split"), CASES)
def test_on_the_cpus_own_path_the_files_decode_as_transformers(variant, split, files, hf_model):
    """The CPU's default path: our quantized matmuls, and the latent attention's decode rows in cpu_mla.c, which
    reads kv_b's halves as int8 blocks only where they hold it exactly (the split layout's Q8_0 attn_k_b and
    attn_v_b; of one Q8_0 attn_kv_b, W_UV's rows but not W_UK's, whose blocks run across the rank): the same
    logits and greedy tokens as transformers on the weights as the file decodes them."""
    path, ref_dir = files(variant, split)
    llm = LLM(str(path), block_size=8)
    assert_matches_transformers(llm, hf_model(ref_dir), PROMPTS, 16)
    if variant != "glm4moe":
        held = llm.engine.model.model.layers[1].self_attn.head_weights
        assert held.source != 0  # the C rows ran
        assert (held.uk.dtype, held.uv.dtype) == (
            (torch.int8, torch.int8) if split else (torch.float32, torch.int8)
        )


@pytest.mark.parametrize("variant", ["deepseek2_v3", "glm4moe"])
def test_quantized_experts_offloaded_or_computed_on_the_host_keep_the_tokens(variant, files):
    """moe_gpu_experts=3 of 8 behind the sigmoid group-limited router, the file's K-quant experts copied in as
    routed to (ExpertCache) or computed where they live (moe_cpu_compute, SplitExperts), as Mixtral's are
    (test_expert_offload.py): the resident model's greedy tokens and logprobs."""
    from backend.models.expert_cache import ExpertCache
    from backend.models.moe import SparseMoE
    from backend.models.split_experts import SplitExperts

    path = str(files(variant, True)[0])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)

    def chosen(out) -> torch.Tensor:
        return torch.tensor([entry[t].logprob for entry, t in zip(out.logprobs, out.token_ids)])

    resident = LLM(path, block_size=8).generate(PROMPTS, params, use_tqdm=False)
    for cpu_compute, kind in ((False, ExpertCache), (True, SplitExperts)):
        llm = LLM(path, block_size=8, moe_gpu_experts=3, moe_cpu_compute=cpu_compute)
        for want, got in zip(resident, llm.generate(PROMPTS, params, use_tqdm=False)):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            torch.testing.assert_close(chosen(got.outputs[0]), chosen(want.outputs[0]), atol=1e-4, rtol=0)
        caches = [m.expert_cache for m in llm.engine.model.modules() if isinstance(m, SparseMoE)]
        assert len(caches) == 2 and all(type(c) is kind and c.slots == 3 for c in caches)
        # experts really came in, or were really computed on the host
        assert all((c.host_pairs if cpu_compute else c.misses) > 0 for c in caches)
