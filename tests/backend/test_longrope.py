"""Phi-3/Phi-4's LongRoPE (short and long per-frequency factors, and the attention factor) against transformers,
from a Hugging Face checkpoint and from a GGUF file as llama.cpp's converter writes it (rope_factors_long/short).

transformers switches by each forward pass's sequence length: the short factors up to the trained length, the long
ones past it. An engine serving past the trained length does the same by sequence (engine/rope_switch.py): a
sequence within it reads the short factors' rows, one past it the long ones'."""

from functools import partial

import pytest

from backend import LLM
from backend.hf_config import from_hf_config
from backend.kernels import native
from tests.backend.conftest import prompts_of_lengths
from tests.backend.test_models_vs_transformers import assert_matches_transformers, prefill_logits
from tests.backend.tiny_models import build_model

TRAINED = 32


def longrope(frequencies: int) -> dict:
    """A LongRoPE config: each frequency its own divisor, the long ones larger (as trained models' are)."""
    ramp = [i / (frequencies - 1) for i in range(frequencies)]
    return dict(
        original_max_position_embeddings=TRAINED,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1 + 3 * r for r in ramp],
            "long_factor": [1 + 19 * r**1.5 for r in ramp],
        },
    )


LONGROPE = longrope(8)  # the tiny models' head_dim 16: 8 frequencies
SHORT, LONG = prompts_of_lengths(3, 17, 24), prompts_of_lengths(33, 50)


@pytest.fixture(scope="module")
def longrope_dir(tmp_path_factory):
    return build_model("phi3", tmp_path_factory.mktemp("longrope") / "phi3", **LONGROPE)


assert_matches = partial(assert_matches_transformers, batched=False)  # a short engine's budget


def test_the_config_reads_both_factor_sets_and_the_attention_factor(longrope_dir):
    import json
    import math

    cfg = from_hf_config(json.loads((longrope_dir / "config.json").read_text()), "phi3")
    scaling = cfg.rope_scaling
    assert scaling["short_factor"] == LONGROPE["rope_parameters"]["short_factor"]
    assert scaling["long_factor"] == LONGROPE["rope_parameters"]["long_factor"]
    assert scaling["original_max_position_embeddings"] == TRAINED
    # 512 positions over 32 trained: sqrt(1 + ln 16 / ln 32), transformers' default
    assert scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(16) / math.log(32)))


def test_short_factors_within_the_trained_length_long_ones_past_it(longrope_dir, hf_model):
    reference = hf_model(longrope_dir)
    short_llm = LLM(str(longrope_dir), block_size=8, max_model_len=TRAINED)
    short = assert_matches(short_llm, reference, SHORT, 8)
    long_llm = LLM(str(longrope_dir), block_size=8, max_model_len=256)
    assert_matches(long_llm, reference, LONG, 16)
    # Short prompts on the long engine: the short factors, as transformers and the short engine
    for ours, theirs in zip(assert_matches(long_llm, reference, SHORT, 8), short):
        assert (ours - theirs).abs().max() < 1e-5
    # The factor sets differ where it shows: the rows of a prompt past the trained length (long factors) and of its
    # start alone (short ones)
    fresh = prompts_of_lengths(40, vocab=350)[0]  # in neither engine's prefix cache
    [long_prompt] = prefill_logits(long_llm, [fresh])
    [its_start] = prefill_logits(short_llm, [fresh[:TRAINED - 1]])
    assert (long_prompt[:TRAINED - 1] - its_start).abs().max() > 1e-2


def test_a_phi3_gguf_with_rope_factors_matches_transformers(tiny_gguf, hf_model, monkeypatch):
    monkeypatch.setattr(native, "enabled", lambda: False)  # transformers' arithmetic (test_gguf_layouts)
    path, ref_dir = tiny_gguf("phi3", "longrope", build=longrope(32))  # the GGUF shapes' head_dim 64
    reference = hf_model(ref_dir)
    assert_matches(LLM(str(path), block_size=8, max_model_len=256), reference, LONG, 16)
    assert_matches(
        LLM(str(path), block_size=8, max_model_len=TRAINED),
        reference,
        SHORT[:2],
        8,
    )
