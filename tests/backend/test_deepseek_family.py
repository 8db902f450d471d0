"""DeepSeek-V2 (latent attention, softmax routers), DeepSeek-V3-shaped (q's low-rank path, the sigmoid router with
its selection bias, YaRN's mscale, a dense first layer) and GLM-4.5-shaped (V3's router over grouped-query
attention) tiny checkpoints against transformers: batched, chunked, with prefix-cache hits and n-gram speculation;
the latent cache's size; attending in the latent space equal to attending over the expanded keys and values.
(test_models_vs_transformers.py compares every family's prefill logits and greedy tokens too.)"""

import json

import pytest
import torch

from backend import LLM, SamplingParams
from backend.engine.kv_budget import kv_bytes_per_block
from backend.hf_config import from_hf_config
from backend.kernels.mla_attention import absorbed_attention, decompressed_attention
from backend.model_config import ModelLoadError
from tests.backend.conftest import hf_greedy, prompts_of_lengths
from tests.backend.test_models_vs_transformers import prefill_logits

FAMILIES = ["deepseek_v2", "deepseek_v2_grouped", "deepseek_v3", "glm4_moe"]
PROMPTS = prompts_of_lengths(5, 19, 33)


def read(tiny_dir, family: str):
    return from_hf_config(json.loads((tiny_dir(family) / "config.json").read_text()), family)


def test_configs_read_into_layer_kinds_and_the_latent_cache(tiny_dir):
    v2, grouped, v3, glm = (read(tiny_dir, f) for f in FAMILIES)
    assert [(s.attention.kind, s.mlp.router) for s in v2.layers] == [("mla", "softmax_topk")] * 2
    assert v2.layers[0].attention.mla.q_lora_rank is None and v2.layers[0].attention.mla.rope_interleaved
    assert (
        v2.shared_expert_intermediate_size == 2 * 24 and not v2.shared_expert_gated and not v2.norm_topk_prob
    )
    assert [s.mlp.router for s in grouped.layers] == [None, "group_limited", "group_limited"]
    assert (grouped.layers[1].mlp.n_group, grouped.layers[1].mlp.topk_group) == (4, 2)
    assert [s.mlp.router for s in v3.layers] == [None, "sigmoid_bias", "sigmoid_bias"]
    assert v3.layers[0].attention.mla.q_lora_rank == 24 and v3.norm_topk_prob
    assert v3.layers[1].mlp.routed_scaling_factor == 2.5
    # q . k scaled by 1/sqrt(nope + rope) times mscale_all_dim's mscale squared (YaRN factor 4)
    assert v3.attention_scale == pytest.approx(
        24**-0.5 * (0.1 * 0.8 * torch.tensor(4.0).log().item() + 1) ** 2
    )
    assert [(s.attention.kind, s.attention.qk_norm) for s in glm.layers] == [("full", "head")] * 3
    assert (glm.rotary_dim, glm.head_dim, glm.qkv_bias, glm.o_bias) == (8, 16, True, False)
    # one row of kv_lora_rank + rope dims a token a layer, against GQA's keys and values of every kv head
    assert kv_bytes_per_block(v3, 8, torch.float32) == 4 * 8 * 3 * (32 + 8)
    assert kv_bytes_per_block(glm, 8, torch.float32) == 4 * 8 * 3 * 2 * 2 * 16


def test_a_router_or_a_format_we_do_not_run_is_refused_by_name(tiny_dir):
    cfg = json.loads((tiny_dir("deepseek_v2") / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="topk_method 'noaux_tc'"):
        from_hf_config({**cfg, "topk_method": "noaux_tc"}, "v2")
    with pytest.raises(ModelLoadError, match="quantization_config 'fp8'"):
        from_hf_config({**cfg, "quantization_config": {"quant_method": "fp8"}}, "v2")


def test_attending_in_the_latent_space_equals_the_expanded_keys_and_values():
    """Every row of a 13-token chunk, attended as a decode row (W_UK absorbed into q, W_UV after), equals the
    chunk's causal attention over the keys and values kv_b_proj expands."""
    torch.manual_seed(0)
    heads, nope, rope, v, lora, block = 4, 16, 8, 12, 32, 4
    cache = torch.randn(6, block, 1, lora + rope)
    w_kv_b = torch.randn(heads * (nope + v), lora) * 0.2
    table = torch.tensor([5, 2, 0, 3, 1])
    context, s = 17, 13
    q_nope, q_pe = torch.randn(s, heads, nope), torch.randn(s, heads, rope)
    expanded = decompressed_attention(q_nope, q_pe, cache, w_kv_b, table, context, 0.3)
    lens = torch.arange(context - s + 1, context + 1)
    absorbed = absorbed_attention(q_nope, q_pe, cache, w_kv_b, table.expand(s, -1), lens, 0.3)
    torch.testing.assert_close(absorbed, expanded, atol=1e-5, rtol=1e-5)
    assert (expanded[0] - expanded[-1]).abs().max() > 1e-2  # rows see different contexts


def test_logits_depend_on_the_selection_bias_the_groups_and_the_mscale(tiny_dir, hf_model):
    """Ours equal transformers'; transformers without the router's bias, without the limit to the best groups, or
    without mscale in the softmax scale, is far from both: the fixture makes each of them count."""
    from transformers import AutoModelForCausalLM

    directory = tiny_dir("deepseek_v3")
    ours = prefill_logits(LLM(str(directory), block_size=8), [PROMPTS[2]])[0]
    prompt = torch.tensor([PROMPTS[2]])
    for ignored in ("bias", "mscale", "groups"):
        other = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
        for layer in other.model.layers:
            if ignored == "bias" and hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.zero_()
            if ignored == "mscale":
                layer.self_attn.scaling = layer.self_attn.qk_head_dim**-0.5
            if ignored == "groups" and hasattr(layer.mlp, "gate"):  # every group kept
                layer.mlp.gate.topk_group = layer.mlp.gate.num_group
        with torch.no_grad():
            far = other(prompt).logits[0]
            expected = hf_model(directory)(prompt).logits[0]
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
        assert (ours - far).abs().max() > 1e-2, ignored


def _hf_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    rows = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return [rows[i, t].item() for i, t in enumerate(tokens)]


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3", "glm4_moe"])
def test_batched_chunked_and_cached_decoding_matches_transformers(family, tiny_dir, hf_model):
    """Prompts of other lengths in one batch, prefilled in chunks of 12 tokens beside decoding rows, then a prompt
    sharing 32 tokens with an earlier one (a prefix-cache hit): transformers' greedy tokens, and each token's
    logprob within 1e-4."""
    directory = tiny_dir(family)
    reference = hf_model(directory)
    llm = LLM(str(directory), block_size=8, max_num_batched_tokens=12)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    shared = PROMPTS[2][:32] + [7, 8, 9]
    outputs = llm.generate([*PROMPTS, shared], params, use_tqdm=False)
    hit = llm.generate([PROMPTS[2][:32] + [11, 12]], params, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 32
    for prompt, out in zip([*PROMPTS, shared, PROMPTS[2][:32] + [11, 12]], [*outputs, hit]):
        tokens = out.outputs[0].token_ids
        assert tokens == hf_greedy(reference, prompt, 10)
        ours = [entry[t].logprob for entry, t in zip(out.outputs[0].logprobs, tokens)]
        torch.testing.assert_close(
            torch.tensor(ours), torch.tensor(_hf_logprobs(reference, prompt, tokens)), atol=1e-4, rtol=0
        )
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("family", ["deepseek_v2_grouped", "deepseek_v3", "glm4_moe"])
def test_ngram_speculation_keeps_plain_decodings_tokens(family, tiny_dir):
    directory = str(tiny_dir(family))
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    repeating = [prompts_of_lengths(24)[0] * 2, PROMPTS[1]]
    plain = [
        o.outputs[0].token_ids
        for o in LLM(directory, block_size=8).generate(repeating, greedy, use_tqdm=False)
    ]
    spec = LLM(
        directory, block_size=8, speculative={"method": "ngram", "num_tokens": 4, "prompt_lookup_min": 1}
    )
    assert [o.outputs[0].token_ids for o in spec.generate(repeating, greedy, use_tqdm=False)] == plain
    assert spec.engine.stats()["spec_draft_tokens"] > 0


def test_experts_offloaded_or_computed_on_the_host_keep_the_tokens(tiny_dir):
    """moe_gpu_experts: 3 of 8 experts a layer resident, the rest copied in as routed to (ExpertCache) or computed
    where they live (moe_cpu_compute, SplitExperts): the resident model's greedy tokens, behind the sigmoid router."""
    from backend.models.moe import SparseMoE

    directory = str(tiny_dir("deepseek_v3"))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids for o in LLM(directory, block_size=8).generate(PROMPTS, params, use_tqdm=False)
    ]
    for cpu_compute in (False, True):
        llm = LLM(directory, block_size=8, moe_gpu_experts=3, moe_cpu_compute=cpu_compute)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == expected
        caches = [m.expert_cache for m in llm.engine.model.modules() if isinstance(m, SparseMoE)]
        assert len(caches) == 2 and all(c is not None and c.slots == 3 for c in caches)


def test_multi_token_prediction_layers_of_the_checkpoint_are_left_out(tiny_dir, tmp_path):
    """DeepSeek-V3's and GLM-4.5's checkpoints keep their MTP layer after the others (model.layers.N with N
    num_hidden_layers): read past, not refused; the outputs are the checkpoint's without it."""
    import shutil

    from safetensors.torch import load_file, save_file

    source = tiny_dir("glm4_moe")
    shutil.copytree(source, tmp_path / "mtp")
    state = load_file(str(source / "model.safetensors"))
    last = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    extra = {
        f"model.layers.{last}.eh_proj.weight": torch.zeros(4, 128),
        f"model.layers.{last}.input_layernorm.weight": torch.ones(64),
    }
    save_file({**state, **extra}, str(tmp_path / "mtp" / "model.safetensors"), metadata={"format": "pt"})
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ours = LLM(str(tmp_path / "mtp"), block_size=8).generate(PROMPTS[:1], params, use_tqdm=False)[0]
    plain = LLM(str(source), block_size=8).generate(PROMPTS[:1], params, use_tqdm=False)[0]
    assert ours.outputs[0].token_ids == plain.outputs[0].token_ids


def test_quantized_at_load_kv_b_stays_in_floats_and_the_arithmetic_counts_it(tmp_path, monkeypatch):
    """quantization=int8: every projection of the latent attention quantized but kv_b_proj, which the attention reads
    as a float matrix; what the model holds is what weight_bytes (--print-memory-need) says."""
    from torch import nn

    from backend.loader import load_model, locate, read_config
    from backend.quant.modules import QuantLinear
    from backend.quant.weight_sizes import hf_recipe, kv_b_decode_copies, module_bytes, weight_bytes
    from tests.backend.tiny_gguf_deepseek import MLA_SHAPES
    from tests.backend.tiny_models import build_model

    monkeypatch.setenv("SCRIPTORIUM_QUANT_CPU", "reference")  # the blocks themselves, as CUDA holds them
    source = locate(str(build_model("deepseek_v3", tmp_path / "v3", **MLA_SHAPES, q_lora_rank=64)))
    cfg, _ = read_config(source)
    model = load_model(source, cfg, None, torch.float32, torch.device("cpu"), 64, quantization="int8")
    attn = model.model.layers[1].self_attn
    assert all(isinstance(p, QuantLinear) for p in (attn.q_a_proj, attn.q_b_proj, attn.kv_a_proj_with_mqa))
    assert type(attn.kv_b_proj) is nn.Linear
    # The C decode rows' copy of kv_b (held on the CPU only, test_held_weight_counts.py) is not what CUDA holds.
    cpu_copy = sum(t.numel() * t.element_size() for t in kv_b_decode_copies(model))
    assert module_bytes(model) - cpu_copy == weight_bytes(cfg, hf_recipe("int8", torch.float32)).total


def test_the_ready_log_says_the_latent_caches_bytes_a_token(tiny_dir, caplog):
    """The engine's ready line counts a latent layer's one row a token, not keys and values of every head."""
    import logging

    from backend import LLM

    with caplog.at_level(logging.INFO, logger="backend.engine.kv_budget"):
        llm = LLM(str(tiny_dir("deepseek_v3")), block_size=8, max_model_len=64, max_num_seqs=2)
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    per_token = kv_bytes_per_block(llm.engine.model_config, 1, llm.engine.shape.kv_dtype)
    assert per_token == 4 * 3 * (32 + 8) and f"({per_token} bytes a token)" in line
