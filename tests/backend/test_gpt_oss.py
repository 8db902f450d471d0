"""gpt-oss against transformers' GptOssForCausalLM (tiny random checkpoints, fp32): its config read into layer
kinds; each of its pieces (sliding windows on every other layer, sinks, the clamped SwiGLU) what the match holds
to; greedy tokens and logprobs batched, with chunked prefill across the window, a prefix-cache hit and n-gram
speculation; OpenAI's MXFP4 experts decoded exactly as the OCP MX format defines."""

import json

import pytest
import torch

from backend import LLM, SamplingParams
from backend.families.gpt_oss_weights import mxfp4_decode
from backend.hf_config import from_hf_config
from backend.layer_spec import MLPSpec
from tests.backend.conftest import hf_greedy, prompts_of_lengths
from tests.backend.test_models_vs_transformers import PROMPTS, assert_each_piece_matters, prefill_logits

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)


def assert_tiny_gpt_oss_layers(config, swiglu_limit: float) -> None:
    """The tiny gpt-oss's layer kinds (a 12-token window on every other layer, sinks on all, 2 of 4 experts with
    biases and the clamped SwiGLU at swiglu_limit), biased projections and YaRN, as config reads them."""
    assert [(s.attention.kind, s.attention.window, s.attention.sinks) for s in config.layers] == [
        ("sliding", 12, True),
        ("full", None, True),
    ] * 2
    assert {s.mlp for s in config.layers} == {
        MLPSpec("moe", "softmax_topk", bias=True, clamped_swiglu=(1.702, swiglu_limit))
    }
    assert config.qkv_bias and config.o_bias and config.norm_topk_prob
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
    assert config.rope_scaling["rope_type"] == "yarn"


def test_gpt_oss_config_reads_into_layer_kinds(tiny_dir):
    cfg = json.loads((tiny_dir("gpt_oss") / "config.json").read_text())
    mc = from_hf_config(cfg, "gpt-oss")
    assert_tiny_gpt_oss_layers(mc, swiglu_limit=1.5)
    assert mc.rope_theta == 150000.0


def reference_changed(directory, sinks: float | None = None, **changes):
    from transformers import AutoModelForCausalLM, GptOssConfig

    config = GptOssConfig.from_pretrained(str(directory), **changes)
    model = AutoModelForCausalLM.from_pretrained(str(directory), config=config, dtype=torch.float32).eval()
    if sinks is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.fill_(sinks)
    return model


def test_each_gpt_oss_piece_is_what_the_match_holds_to(tiny_dir, hf_model):
    """Our logits equal transformers' and are far from it with any one piece changed: no window, no sinks (a
    sink far below every score), no clamp on the SwiGLU."""
    directory = tiny_dir("gpt_oss")
    reference = hf_model(directory)
    changed = {
        "no window": reference_changed(directory, sliding_window=512),
        "no sinks": reference_changed(directory, sinks=-1e4),
        "no clamp": reference_changed(directory, swiglu_limit=1e4),
    }
    assert_each_piece_matters(LLM(str(directory), block_size=8), reference, changed, window=12)


def hf_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.double(), dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def assert_as_transformers(reference, prompts, outputs, max_tokens: int) -> None:
    for prompt, out in zip(prompts, outputs):
        tokens = out.outputs[0].token_ids
        assert tokens == hf_greedy(reference, prompt, max_tokens)
        ours = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, tokens)]
        assert ours == pytest.approx(hf_logprobs(reference, prompt, tokens), abs=1e-4)


def test_gpt_oss_batched_and_chunked_decoding_matches_transformers(tiny_dir, hf_model):
    """Prompts of 3 to 50 tokens (the window 12) batched, decoding past the window; then chunks of 12 tokens (the
    window's length) beside decodes."""
    directory = tiny_dir("gpt_oss")
    reference = hf_model(directory)
    batched = LLM(str(directory), block_size=8).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_as_transformers(reference, PROMPTS, batched, 16)
    chunked = LLM(str(directory), block_size=8, max_num_batched_tokens=12).generate(
        PROMPTS, GREEDY, use_tqdm=False
    )
    assert_as_transformers(reference, PROMPTS, chunked, 16)


def test_gpt_oss_prefix_cache_hit_matches_transformers(tiny_dir, hf_model):
    directory = tiny_dir("gpt_oss")
    prefix = prompts_of_lengths(40)[0]
    first, second = prefix + [7, 8, 9], prefix + [11, 12, 13, 14, 15]
    llm = LLM(str(directory), block_size=8)
    llm.generate(first, GREEDY, use_tqdm=False)
    out = llm.generate(second, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 40
    assert_as_transformers(hf_model(directory), [second], [out], 16)


def test_mxfp4_decodes_every_code_and_scale_as_transformers_does():
    """Every E2M1 code under every E8M0 scale but NaN's (255), the subnormal 2^-127 included: the same bits as
    transformers' reader of OpenAI's checkpoints."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    scales = (
        torch.arange(255, dtype=torch.uint8).view(1, 255, 1).expand(1, 255, 2).contiguous()
    )  # [E, rows, G]
    codes = torch.arange(256, dtype=torch.int32).remainder(256).to(torch.uint8)
    blocks = codes.view(16, 16)[None, None].expand(1, 255, 2, 16, 16).reshape(1, 255, 32, 16)[:, :, :2]
    ours = mxfp4_decode(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    assert torch.equal(ours.view(torch.int32), theirs.contiguous().view(torch.int32))
    assert ours[0, 127, :16].tolist() == [
        0.0,
        0.0,
        0.5,
        0.0,
        1.0,
        0.0,
        1.5,
        0.0,
        2.0,
        0.0,
        3.0,
        0.0,
        4.0,
        0.0,
        6.0,
        0.0,
    ]  # scale 2^0; byte j = j: low nibble j, high nibble 0
    assert torch.isnan(mxfp4_decode(blocks[:, :1], torch.full((1, 1, 2), 255, dtype=torch.uint8))).all()


def test_gpt_oss_experts_quantized_at_load_keep_their_biases_and_clamp(tiny_dir, hf_model):
    """quantization="int8" keeps the experts in blocks (QuantExperts) with their biases and the clamped SwiGLU: its
    logits sit within the quantization's error of transformers', far closer than a model without the clamp or
    without the experts' biases."""
    from backend.quant.experts import QuantExperts

    directory = tiny_dir("gpt_oss")
    reference = hf_model(directory)
    no_bias = reference_changed(directory)
    with torch.no_grad():
        for layer in no_bias.model.layers:
            layer.mlp.experts.gate_up_proj_bias.zero_()
            layer.mlp.experts.down_proj_bias.zero_()
    changed = [reference_changed(directory, swiglu_limit=1e4), no_bias]
    llm = LLM(str(directory), block_size=8, quantization="int8")
    assert isinstance(llm.engine.model.model.layers[0].mlp.experts, QuantExperts)
    for prompt, ours in zip(PROMPTS, prefill_logits(llm, PROMPTS)):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = reference(ids).logits[0]
            nearest_wrong = min((model(ids).logits[0] - expected).abs().mean().item() for model in changed)
        assert (ours - expected).abs().mean().item() < 0.2 * nearest_wrong
