"""Qwen3-Next and Qwen3.5-MoE: Gated DeltaNet linear-attention layers with a gated full-attention layer every
full_attention_interval-th (3:1), (1 + w) RMSNorms, q/k norms per head, partial rotary (a quarter of each head by
default) and experts with a sigmoid-gated shared expert (Qwen2-MoE's). Qwen3.5's multimodal checkpoints
(ForConditionalGeneration) keep the text model's keys in text_config; only the text model runs."""

from backend.layer_spec import DENSE, MOE_SOFTMAX_TOPK, AttentionSpec, DeltaNetShape, LayerSpec, MLPSpec
from backend.model_config import (
    ModelConfig,
    ModelLoadError,
    base_config,
    config_int,
    config_list,
    layer_types,
    rotary_dim_of,
)

_QWEN35 = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
ARCHITECTURES = ("Qwen3NextForCausalLM", *_QWEN35)
DEFAULT_ROTARY_FACTOR = 0.25  # these configs' own default when they name none


def from_hf(cfg: dict, arch: str, source: str) -> ModelConfig:
    if arch == "Qwen3_5MoeForConditionalGeneration":
        cfg = _text_config(cfg, source)
    mc = base_config(cfg, arch, source)
    mc.qkv_bias = mc.o_bias = bool(cfg.get("attention_bias", False))
    mc.norm_unit_offset = True
    params = cfg.get("rope_parameters") or {}  # base_config checked that it is an object
    if "partial_rotary_factor" not in params and "partial_rotary_factor" not in cfg:
        cfg = {**cfg, "partial_rotary_factor": DEFAULT_ROTARY_FACTOR}
    mc.rotary_dim = rotary_dim_of(cfg, mc.head_dim, source)
    mc.num_experts = config_int(cfg, "num_experts", source, 0, minimum=0)
    if mc.num_experts:
        mc.num_experts_per_tok = config_int(cfg, "num_experts_per_tok", source)
        if mc.num_experts_per_tok > mc.num_experts:
            raise ModelLoadError(
                f"{source}: num_experts_per_tok={mc.num_experts_per_tok} is more than the "
                f"{mc.num_experts} experts"
            )
        mc.moe_intermediate_size = config_int(cfg, "moe_intermediate_size", source)
        # Qwen3.5's router always renormalises its top k
        mc.norm_topk_prob = True if arch in _QWEN35 else bool(cfg.get("norm_topk_prob", True))
        mc.shared_expert_intermediate_size = config_int(
            cfg, "shared_expert_intermediate_size", source, 0, minimum=0
        )
    linear = DeltaNetShape(
        num_key_heads=config_int(cfg, "linear_num_key_heads", source, 16),
        num_value_heads=config_int(cfg, "linear_num_value_heads", source, 32),
        key_head_dim=config_int(cfg, "linear_key_head_dim", source, 128),
        value_head_dim=config_int(cfg, "linear_value_head_dim", source, 128),
        conv_kernel=config_int(cfg, "linear_conv_kernel_dim", source, 4),
    )
    if linear.num_value_heads % linear.num_key_heads:
        raise ModelLoadError(
            f"{source}: linear_num_value_heads={linear.num_value_heads} is not a multiple of "
            f"linear_num_key_heads={linear.num_key_heads}"
        )
    interval = config_int(cfg, "full_attention_interval", source, 4)
    every = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(mc.num_layers)
    ]
    types = layer_types(cfg, source, ("linear_attention", "full_attention"), mc.num_layers, every)
    mc.layers = tuple(
        LayerSpec(_attention(types[i], linear), _mlp(cfg, arch, i, source)) for i in range(mc.num_layers)
    )
    return mc


def _text_config(cfg: dict, source: str) -> dict:
    """The text model's keys of a multimodal checkpoint; the end tokens and tying may sit at the top level."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(f"{source}: a Qwen3.5 multimodal config.json without its text_config")
    merged = dict(text)
    for key in ("eos_token_id", "tie_word_embeddings"):
        if merged.get(key) is None and cfg.get(key) is not None:
            merged[key] = cfg[key]
    return merged


def _attention(kind: str, linear: DeltaNetShape) -> AttentionSpec:
    if kind == "linear_attention":
        return AttentionSpec("linear", linear=linear)
    return AttentionSpec("full", qk_norm="head", output_gate=True)


def _mlp(cfg: dict, arch: str, i: int, source: str) -> MLPSpec:
    """Qwen3.5-MoE: experts in every layer; Qwen3-Next: Qwen2-MoE's decoder_sparse_step and mlp_only_layers."""
    if not cfg.get("num_experts"):
        return DENSE
    if arch in _QWEN35:
        return MOE_SOFTMAX_TOPK
    step = config_int(cfg, "decoder_sparse_step", source, 1)
    sparse = i not in (config_list(cfg, "mlp_only_layers", source) or []) and (i + 1) % step == 0
    return MOE_SOFTMAX_TOPK if sparse else DENSE
