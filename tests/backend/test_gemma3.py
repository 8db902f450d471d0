"""Gemma 3 (text): its config read into per-layer kinds, and each of its pieces held to transformers: the sliding
window, a rotary base per layer kind, the (1 + w) norms, the logits softcap (its one-call C step:
test_gemma3_one_call.py)."""

import json

import pytest
import torch

from backend import LLM, SamplingParams
from backend.hf_config import from_hf_config
from backend.model_config import ModelLoadError
from tests.backend.conftest import hf_greedy
from tests.backend.test_models_vs_transformers import (
    PROMPTS,
    assert_each_piece_matters,
    assert_logits_match,
)
from tests.backend.tiny_models import GEMMA3_ROPE, build_model


def kinds(cfg) -> list[tuple]:
    return [
        (s.attention.kind, s.attention.window, s.attention.rope_theta, s.attention.qk_norm)
        for s in cfg.layers
    ]


def test_gemma3_config_reads_into_layer_kinds(tiny_dir):
    cfg = json.loads((tiny_dir("gemma3") / "config.json").read_text())
    mc = from_hf_config(cfg, "gemma3")
    sliding, full = ("sliding", 12, 10000.0, "head"), ("full", None, None, "head")
    assert kinds(mc) == [sliding, sliding, full] * 2
    assert mc.rope_theta == 1e6 and mc.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert (
        mc.attention_scale == 24**-0.5
        and mc.embedding_multiplier == 8.0
        and mc.hidden_act == "gelu_pytorch_tanh"
    )
    # A checkpoint of older transformers (google/gemma-3-1b-it's keys): flat rope keys, a pattern for the layers
    old = {
        k: v for k, v in cfg.items() if k not in ("rope_parameters", "layer_types", "_sliding_window_pattern")
    }
    old.update(
        rope_theta=1e6,
        rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window_pattern=3,
    )
    legacy = from_hf_config(old, "gemma3-legacy")
    assert kinds(legacy) == kinds(mc) and legacy.rope_scaling == mc.rope_scaling and legacy.rope_theta == 1e6
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping"):
        from_hf_config({**cfg, "attn_logit_softcapping": 50.0}, "gemma3")


def reference_changed(directory, **changes):
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig.from_pretrained(str(directory), **changes)
    return AutoModelForCausalLM.from_pretrained(str(directory), config=config, dtype=torch.float32).eval()


def without_unit_offset(model):
    """The same model with every norm scaling by its weight w, not 1 + w (transformers' with w - 1 stored)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.sub_(1.0)
    return model


def test_each_gemma3_piece_is_what_the_match_holds_to(tiny_dir, hf_model):
    """Our logits equal transformers' Gemma 3 and are far from it with any one piece changed: a window past every
    prompt, one rotary base for every layer, norms scaling by w."""
    directory = tiny_dir("gemma3")
    reference = hf_model(directory)
    changed = {
        "no window": reference_changed(directory, sliding_window=512),
        "one rotary base": reference_changed(
            directory, rope_parameters={kind: dict(GEMMA3_ROPE["full_attention"]) for kind in GEMMA3_ROPE}
        ),
        "norms by w": without_unit_offset(reference_changed(directory)),
    }
    assert_each_piece_matters(LLM(str(directory), block_size=8), reference, changed, window=12)


def test_gemma3_chunked_prefill_across_the_window_matches_transformers(tiny_dir, hf_model):
    """Chunks of 12 tokens (the window's length) beside decodes, then decoding past the window."""
    directory = tiny_dir("gemma3")
    llm = LLM(str(directory), block_size=8, max_num_batched_tokens=12)
    outputs = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )
    reference = hf_model(directory)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, 20)


def test_gemma3_final_logit_softcap_matches_transformers(tmp_path, hf_model):
    directory = build_model("gemma3", tmp_path / "capped", final_logit_softcapping=3.0)
    reference = hf_model(directory)
    llm = LLM(str(directory), block_size=8)
    for ours in assert_logits_match(llm, reference, PROMPTS):
        assert ours.abs().max() < 3.0  # capped: the uncapped logits of this model reach past 7
