"""YaRN against transformers, and how max_model_len and rope_scaling choose it."""

import pytest
import torch

from backend import LLM, SamplingParams
from backend.context_length import fit_context, parse_rope_scaling
from backend.kernels.rotary import attention_factor, inverse_frequencies
from backend.loader import locate, read_config
from tests.backend.conftest import hf_greedy, prompts_of_lengths
from tests.backend.test_models_vs_transformers import assert_logits_match, prefill_logits
from tests.backend.tiny_models import build_model

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
PROMPTS = prompts_of_lengths(70, 180)  # past the 64 trained positions, in one step of 256 tokens


@pytest.mark.parametrize("extra", [{}, {"truncate": False}, {"beta_fast": 16, "beta_slow": 2},
                                   {"mscale": 0.707, "mscale_all_dim": 1.0}, {"attention_factor": 0.9},
                                   {"factor": 8.0, "original_max_position_embeddings": 8192}])
def test_yarn_frequencies_and_attention_factor_are_transformers(extra):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {**YARN, **extra}
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=65536,
                         rope_parameters={**rope, "rope_theta": 100000.0})
    expected, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    torch.testing.assert_close(inverse_frequencies(64, 100000.0, rope), expected, atol=0, rtol=1e-6)
    assert attention_factor(rope) == pytest.approx(expected_factor, rel=1e-12)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_yarn_checkpoint_matches_transformers_past_its_trained_length(family, tmp_path, hf_model):
    directory = build_model(family, tmp_path / family, rope_scaling=dict(YARN))
    reference = hf_model(directory)
    llm = LLM(str(directory), block_size=8)
    assert llm.engine.max_model_len == 256  # 64 trained positions times 4
    for prompt, ours in zip(PROMPTS, prefill_logits(llm, PROMPTS)):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(reference, PROMPTS[1], 16)


def test_a_yarn_gguf_matches_transformers(tiny_gguf, hf_model):
    path, reference_dir = tiny_gguf("llama", "yarn", build={"rope_scaling": dict(YARN)}, policy={})
    config, _ = read_config(locate(str(path)))
    assert config.rope_scaling == YARN
    reference = hf_model(reference_dir)
    assert_logits_match(LLM(str(path), block_size=8), reference, PROMPTS)


def test_rope_scaling_setting_is_transformers_yarn_on_a_plain_checkpoint(tmp_path, hf_model):
    """The same weights trained at 64 positions: rope_scaling="yarn:4" runs them as the yarn config does."""
    plain = build_model("llama", tmp_path / "plain", max_position_embeddings=64)
    reference = hf_model(build_model("llama", tmp_path / "yarn", rope_scaling=dict(YARN)))
    for llm in (LLM(str(plain), block_size=8, rope_scaling="yarn:4"),
                LLM(str(plain), block_size=8, max_model_len=256)):  # YaRN x4 chosen for the length
        assert llm.engine.max_model_len == 256
        ours = prefill_logits(llm, PROMPTS[1:])[0]
        with torch.no_grad():
            torch.testing.assert_close(ours, reference(torch.tensor([PROMPTS[1]])).logits[0], atol=1e-4, rtol=1e-4)


def test_the_length_chooses_yarn_only_past_the_trained_length(tiny_dir):
    config, _ = read_config(locate(str(tiny_dir("llama"))))  # trained at 512 positions
    assert fit_context(config, None, None) == (config, 512)
    assert fit_context(config, None, 512) == (config, 512)
    scaled, length = fit_context(config, None, 1500)
    assert length == 1500
    assert scaled.rope_scaling == {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 512}
    assert fit_context(config, "yarn", None)[1] == 2048
    assert fit_context(config, "yarn:8", 1000)[1] == 1000
    with pytest.raises(ValueError, match=r"past the 512 tokens .* pass rope_scaling yarn \(--rope-scaling yarn\)"):
        fit_context(config, "none", 1000)
    with pytest.raises(ValueError, match="past the 1024 tokens .* raise its factor"):
        fit_context(config, "yarn:2", 1500)


def test_rope_scaling_spellings():
    assert parse_rope_scaling("none") == "none"
    assert parse_rope_scaling("yarn") == {"rope_type": "yarn"}
    assert parse_rope_scaling("yarn:8") == {"rope_type": "yarn", "factor": 8.0}
    assert parse_rope_scaling('{"type": "yarn", "factor": 4}') == {"rope_type": "yarn", "factor": 4}
    for bad, message in (("dynamic", "not supported"), ("yarn:x", "must be a number"), ("{", "not valid JSON"),
                         ("yarn:0.5", "factor must be a number >= 1"), ("linear", "needs a factor")):
        with pytest.raises(ValueError, match=message):
            parse_rope_scaling(bad)
