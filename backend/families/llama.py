"""The Llama lineage and the families that differ from it by flags: Llama, Mistral, Mixtral, Qwen2/Qwen3 (and
their MoE), SmolLM3 (NoPE layers), Phi-3/Phi-4 (fused projections, partial rotary, LongRoPE), OLMoE (q/k norms
over the whole projection) and Granite-MoE (its four multipliers, an ungated shared expert)."""

from backend.layer_spec import DENSE, MOE_SOFTMAX_TOPK, LayerSpec, attention_of
from backend.model_config import (
    ModelConfig,
    ModelLoadError,
    base_config,
    config_float,
    config_int,
    config_list,
    rotary_dim_of,
)

_GRANITE_MOE = ("GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM")
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "SmolLM3ForCausalLM",
                 "Phi3ForCausalLM", "OlmoeForCausalLM", *_GRANITE_MOE)


def from_hf(cfg: dict, arch: str, source: str) -> ModelConfig:
    if cfg.get("use_sliding_window") and arch != "SmolLM3ForCausalLM":
        raise ModelLoadError(f"{source}: use_sliding_window=true (Qwen's per-layer windows) is not supported")
    mc = base_config(cfg, arch, source)
    if arch in ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "SmolLM3ForCausalLM",
                "OlmoeForCausalLM", *_GRANITE_MOE):
        mc.qkv_bias = mc.o_bias = bool(cfg.get("attention_bias", False))
        mc.mlp_bias = bool(cfg.get("mlp_bias", False))
    if arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
        mc.qkv_bias = True  # Qwen2 always has q/k/v biases and none on o_proj
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        mc.qkv_bias = bool(cfg.get("attention_bias", False))
        mc.o_bias = mc.qkv_bias
    if arch == "Phi3ForCausalLM":
        mc.rotary_dim = rotary_dim_of(cfg, mc.head_dim, source)
    if arch == "MixtralForCausalLM":
        mc.num_experts = config_int(cfg, "num_local_experts", source)
        mc.num_experts_per_tok = _experts_per_tok(cfg, mc, source)
        mc.moe_intermediate_size = mc.intermediate_size
        mc.norm_topk_prob = True  # Mixtral always renormalises its top-k weights
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        mc.num_experts = _num_experts(cfg, source, "num_experts", "num_local_experts")  # transformers 5: the latter
        mc.num_experts_per_tok = _experts_per_tok(cfg, mc, source)
        mc.moe_intermediate_size = config_int(cfg, "moe_intermediate_size", source)
        mc.norm_topk_prob = bool(cfg.get("norm_topk_prob", False))
    if arch == "OlmoeForCausalLM":
        if cfg.get("clip_qkv") is not None:
            raise ModelLoadError(f"{source}: clip_qkv (OLMoE's clamped q/k/v) is not supported")
        mc.num_experts = _num_experts(cfg, source, "num_experts", "num_local_experts")
        mc.num_experts_per_tok = _experts_per_tok(cfg, mc, source)
        mc.moe_intermediate_size = mc.intermediate_size  # OLMoE's experts are its only feed-forward
        mc.norm_topk_prob = bool(cfg.get("norm_topk_prob", False))
    if arch in _GRANITE_MOE:
        _granite_moe(mc, cfg, source)
    if arch == "Qwen2MoeForCausalLM":
        mc.shared_expert_intermediate_size = config_int(cfg, "shared_expert_intermediate_size", source, 0, minimum=0)
    mc.layers = tuple(_hf_layer(arch, cfg, i, source) for i in range(mc.num_layers))
    return mc


def _hf_layer(arch: str, cfg: dict, i: int, source: str) -> LayerSpec:
    """Layer i's kinds, from the family's own way of saying them."""
    window, rope = None, True
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        # one window for every layer, or none (null, or 0 as some Phi configs and llama.cpp's phi3 write it)
        window = config_int(cfg, "sliding_window", source, None, minimum=0) or None
    if arch == "SmolLM3ForCausalLM":
        rope = _smollm3_rope(cfg, source)[i]
        if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
            types = config_list(cfg, "layer_types", source) or ["full_attention" if r else "sliding_attention"
                                               for r in _smollm3_rope(cfg, source)]
            window = config_int(cfg, "sliding_window", source) if types[i] == "sliding_attention" else None
    qk_norm = {"Qwen3ForCausalLM": "head", "Qwen3MoeForCausalLM": "head", "OlmoeForCausalLM": "full"}.get(arch)
    attention = attention_of(window, rope=rope, qk_norm=qk_norm)
    if arch in ("MixtralForCausalLM", "OlmoeForCausalLM", *_GRANITE_MOE):
        return LayerSpec(attention, MOE_SOFTMAX_TOPK)
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        step = config_int(cfg, "decoder_sparse_step", source, 1)
        sparse = i not in (config_list(cfg, "mlp_only_layers", source) or []) and (i + 1) % step == 0
        return LayerSpec(attention, MOE_SOFTMAX_TOPK if sparse else DENSE)
    return LayerSpec(attention, DENSE)


def _granite_moe(mc: ModelConfig, cfg: dict, source: str) -> None:
    """Granite-MoE's experts (its router's softmax over the top-k logits is softmax_topk renormalised), its ungated
    shared expert (GraniteMoeShared), and its four scalars."""
    mc.num_experts = _num_experts(cfg, source, "num_local_experts", "num_experts")
    mc.num_experts_per_tok = _experts_per_tok(cfg, mc, source)
    mc.moe_intermediate_size = mc.intermediate_size
    mc.norm_topk_prob = True
    mc.shared_expert_intermediate_size = config_int(cfg, "shared_intermediate_size", source, 0, minimum=0)
    mc.shared_expert_gated = False
    mc.embedding_multiplier = config_float(cfg, "embedding_multiplier", source, 1.0)
    mc.residual_multiplier = config_float(cfg, "residual_multiplier", source, 1.0)
    mc.logits_scaling = config_float(cfg, "logits_scaling", source, 1.0, positive=True)
    mc.attention_scale = config_float(cfg, "attention_multiplier", source, mc.head_dim**-0.5)


def _smollm3_rope(cfg: dict, source: str) -> list[bool]:
    """Whether each layer rotates: config.json's `no_rope_layers` (1: rotates, 0: a NoPE layer, despite the name),
    else every `no_rope_layer_interval`-th layer (4 by default) is NoPE."""
    layers = config_int(cfg, "num_hidden_layers", source)
    flags = config_list(cfg, "no_rope_layers", source)
    if flags is None:
        interval = config_int(cfg, "no_rope_layer_interval", source, 4)
        return [(i + 1) % interval != 0 for i in range(layers)]
    if len(flags) != layers:
        raise ModelLoadError(f"{source}: no_rope_layers has {len(flags)} entries for {layers} layers")
    return [bool(f) for f in flags]


def _num_experts(cfg: dict, source: str, key: str, other: str) -> int:
    """The expert count, under `key` or (as another transformers version writes it) `other`."""
    return config_int(cfg, key if cfg.get(key) is not None else other, source)


def _experts_per_tok(cfg: dict, mc: ModelConfig, source: str) -> int:
    k = config_int(cfg, "num_experts_per_tok", source)
    if k > mc.num_experts:
        raise ModelLoadError(f"{source}: num_experts_per_tok={k} is more than the {mc.num_experts} experts")
    return k
