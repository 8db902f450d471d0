"""gemma3 GGUF files in llama.cpp's layout (tiny_gguf_gemma3.py), F32 and Q4_K_M's formats: read into the same
layer kinds as the model's config.json, and decoding as transformers does on the weights as the file holds them
(norms stored as 1 + w, the sandwich norms under their own names, the embedding cut to the tokenizer's rows)."""

import numpy as np
import pytest
from gguf import GGUFWriter

from backend import LLM
from backend.hf_config import from_hf_config
from backend.kernels import native
from backend.loader import locate, read_config
from backend.quant.modules import QuantLinear
from backend.quant.weight_sizes import file_recipe, module_bytes, weight_bytes
from tests.backend.conftest import prompts_of_lengths
from tests.backend.test_models_vs_transformers import assert_matches_transformers
from tests.backend.tiny_gguf_gemma3 import write_gguf

PROMPTS = prompts_of_lengths(3, 17, 33)  # past the 12-token window
# The F32 file also carries a logits softcap (low enough to act on these logits)
CASES = {"F32": dict(final_logit_softcapping=5.0), "Q4_K_M": {}}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root, built = tmp_path_factory.mktemp("gemma3-gguf"), {}

    def get(policy: str):
        if policy not in built:
            built[policy] = write_gguf(policy, root, **CASES[policy])
        return built[policy]

    return get


def kinds(cfg) -> list[tuple]:
    return [
        (s.attention.kind, s.attention.window, s.attention.rope_theta, s.attention.qk_norm)
        for s in cfg.layers
    ]


@pytest.mark.parametrize("policy", list(CASES))
def test_gemma3_files_match_transformers(policy, files, hf_model, monkeypatch):
    monkeypatch.setattr(native, "enabled", lambda: False)  # transformers' arithmetic (test_gguf_layouts.py)
    path, ref_dir = files(policy)
    config, reader = read_config(locate(str(path)))
    reference = hf_model(ref_dir)
    assert config.architecture == type(reference).__name__
    # llama.cpp's constants (the 5:1 pattern, the local base) and the file's keys give what config.json says
    from_json = from_hf_config(reference.config.to_dict() | {"architectures": ["Gemma3ForCausalLM"]}, "ref")
    assert kinds(config) == kinds(from_json)
    assert (config.rope_theta, config.rope_scaling) == (from_json.rope_theta, from_json.rope_scaling)
    assert config.attention_scale == from_json.attention_scale
    assert config.final_logit_softcap == reference.config.final_logit_softcapping
    assert config.vocab_size == reference.config.vocab_size  # the converter's cut rows
    llm = LLM(str(path), block_size=8)
    assert module_bytes(llm.engine.model) == weight_bytes(config, file_recipe(reader)).total
    assert isinstance(llm.engine.model.model.layers[0].self_attn.o_proj, QuantLinear) == (policy != "F32")
    assert_matches_transformers(llm, reference, PROMPTS, 16)


def header_only(path, layers: int, hidden: int, heads: int, head_dim: int, window: int | None):
    """A gemma3 file's keys and the tensors gguf_config reads, at a release's widths."""
    writer = GGUFWriter(str(path), "gemma3")
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads // 2)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if window:
        writer.add_sliding_window(window)
    writer.add_tensor("token_embd.weight", np.zeros((4, hidden), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return read_config(locate(str(path)))[0]


def test_gemma3_file_scales_q_as_the_releases_query_pre_attn_scalar(tmp_path):
    """No key carries query_pre_attn_scalar: the 27B's (62 layers) is hidden / heads = 168, the others' 256 =
    head_dim; without a window every layer is full, with the model's base."""
    big = header_only(tmp_path / "27b.gguf", layers=62, hidden=5376, heads=32, head_dim=128, window=1024)
    assert big.attention_scale == 168**-0.5
    assert [s.attention.kind for s in big.layers[:6]] == ["sliding"] * 5 + ["full"]
    small = header_only(tmp_path / "4b.gguf", layers=34, hidden=2560, heads=8, head_dim=256, window=None)
    assert small.attention_scale == 256**-0.5
    assert {(s.attention.kind, s.attention.rope_theta) for s in small.layers} == {("full", None)}
