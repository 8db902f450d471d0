"""deepseek2 (both of llama.cpp's kv_b layouts) and glm4moe GGUF files, K-quants and Q8_0 (tiny_gguf_deepseek.py):
logits and greedy tokens against transformers on the weights as the file decodes them."""

import pytest

from backend import LLM
from backend.kernels import native
from backend.loader import locate, read_config
from backend.quant.modules import QuantLinear
from backend.quant.weight_sizes import file_recipe, module_bytes, weight_bytes
from tests.backend.conftest import prompts_of_lengths
from tests.backend.test_models_vs_transformers import assert_matches_transformers
from tests.backend.tiny_gguf_deepseek import write_gguf

PROMPTS = prompts_of_lengths(3, 17, 33)
CASES = [("deepseek2_v2", True), ("deepseek2_v2", False), ("deepseek2_v3", True), ("glm4moe", True)]


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
    llm = LLM(str(path), block_size=8)
    # what --print-memory-need and moe_gpu_experts="auto" count is what the model holds
    assert module_bytes(llm.engine.model) == weight_bytes(config, file_recipe(reader)).total
    attn = llm.engine.model.model.layers[1].self_attn
    if variant != "glm4moe":
        assert isinstance(attn.kv_a_proj_with_mqa, QuantLinear)
        assert not isinstance(attn.kv_b_proj, QuantLinear)  # attn_kv_b, or its split halves, as floats
    assert_matches_transformers(llm, reference, PROMPTS, 16)
