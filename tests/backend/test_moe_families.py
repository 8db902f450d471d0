"""OLMoE (q/k RMSNorm over the whole projection) and Granite-MoE (embedding, residual, attention and logits
multipliers; GraniteMoeShared's ungated shared expert): read into the model description, sensitive fixtures (the
families' checkpoints in tiny_models.py differ from transformers where any of these is ignored, so
test_models_vs_transformers would catch it), and the C loop's one-call decode step, bit for bit the modules'."""

import json

import pytest
import torch

from backend import LLM
from backend.hf_config import from_hf_config
from backend.kernels import native
from backend.model_config import ModelLoadError
from tests.backend.test_cpu_decoder import assert_one_call_is_the_modules, one_call_engine
from tests.backend.test_models_vs_transformers import PROMPTS, prefill_logits
from tests.backend.tiny_models import build_model

PROMPT = torch.tensor([PROMPTS[2]])


def read(tiny_dir, family: str):
    return from_hf_config(json.loads((tiny_dir(family) / "config.json").read_text()), family)


def test_olmoe_and_granite_moe_read_into_the_model_description(tiny_dir):
    olmoe = read(tiny_dir, "olmoe")
    assert [(s.attention.qk_norm, s.mlp.kind) for s in olmoe.layers] == [("full", "moe")] * 2
    assert (olmoe.num_experts, olmoe.moe_intermediate_size, olmoe.norm_topk_prob) == (4, 96, False)
    granite = read(tiny_dir, "granitemoe")
    assert [(s.attention.qk_norm, s.mlp.kind) for s in granite.layers] == [(None, "moe")] * 2
    assert (
        granite.embedding_multiplier,
        granite.residual_multiplier,
        granite.logits_scaling,
        granite.attention_scale,
    ) == (12.0, 0.22, 8.0, 0.015)
    assert granite.norm_topk_prob and granite.shared_expert_intermediate_size == 0
    shared = read(tiny_dir, "granitemoe_shared")
    assert shared.shared_expert_intermediate_size == 80 and not shared.shared_expert_gated


def test_olmoe_clip_qkv_is_refused_by_name(tiny_dir):
    cfg = json.loads((tiny_dir("olmoe") / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="clip_qkv"):
        from_hf_config({**cfg, "clip_qkv": 8.0}, "olmoe")


def _per_head_norm(norm, heads: int):
    """An RMSNorm over each head of the projection, with the whole-projection norm's weights."""

    def forward(x):
        h = x.float().unflatten(-1, (heads, -1))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        return norm.weight * h.flatten(-2).to(x.dtype)

    return forward


def test_olmoe_logits_depend_on_the_norm_spanning_all_of_q_and_k(tiny_dir, hf_model):
    """Ours equal transformers' and are far from what a per-head q/k norm gives on the same weights."""
    from transformers import AutoModelForCausalLM

    directory = tiny_dir("olmoe")
    ours = prefill_logits(LLM(str(directory), block_size=8), [PROMPTS[2]])[0]
    per_head = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    cfg = per_head.config
    for layer in per_head.model.layers:
        layer.self_attn.q_norm.forward = _per_head_norm(layer.self_attn.q_norm, cfg.num_attention_heads)
        layer.self_attn.k_norm.forward = _per_head_norm(layer.self_attn.k_norm, cfg.num_key_value_heads)
    with torch.no_grad():
        expected = hf_model(directory)(PROMPT).logits[0]
        other = per_head(PROMPT).logits[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    assert (ours - other).abs().max() > 1e-2


@pytest.mark.parametrize("ignored", ["embedding", "residual", "attention", "logits"])
def test_granite_logits_depend_on_each_multiplier(ignored, tiny_dir, hf_model):
    """Ours equal transformers'; transformers with any one multiplier set to 1 is far from both."""
    from transformers import AutoModelForCausalLM

    directory = tiny_dir("granitemoe_shared")
    ours = prefill_logits(LLM(str(directory), block_size=8), [PROMPTS[2]])[0]
    other = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    if ignored == "embedding":
        other.model.embedding_multiplier = 1.0
    for layer in other.model.layers:
        if ignored == "residual":
            layer.residual_multiplier = 1.0
        if ignored == "attention":
            layer.self_attn.scaling = layer.self_attn.head_dim**-0.5
    if ignored == "logits":
        other.config.logits_scaling = 1.0
    with torch.no_grad():
        expected = hf_model(directory)(PROMPT).logits[0]
        far = other(PROMPT).logits[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    assert (ours - far).abs().max() > 1e-2


@pytest.mark.skipif(native.library() is None, reason="no C compiler for the CPU kernels")
@pytest.mark.parametrize("family", ["olmoe", "granitemoe_shared"])
def test_the_one_call_step_is_the_modules_for_olmoe_and_granite(family, tmp_path):
    """Quantized at load (widths of whole 32-blocks): the C loop norms all of q and of k at once (OLMoE), scales
    each branch and the embeddings and takes Granite's attention scale, and adds the ungated shared expert; its
    logits are the modules' bits."""
    directory = build_model(family, tmp_path / family, shared_intermediate_size=64)
    engine = one_call_engine(directory)
    decoder = engine.runner.cpu_decoder
    assert decoder is not None
    layer = decoder.layers[0]
    assert layer.qk_norm_full == (family == "olmoe")
    assert decoder.shape.residual_scale == pytest.approx(engine.model_config.residual_multiplier)
    if family == "granitemoe_shared":
        assert layer.moe.shared_inter == 64 and not layer.moe.shared_gate
    assert_one_call_is_the_modules(engine)
