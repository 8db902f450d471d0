"""Qwen3-Next and Qwen3.5-MoE: Gated DeltaNet linear-attention layers with a gated full-attention layer every
full_attention_interval-th (3:1), (1 + w) RMSNorms, q/k norms per head, partial rotary (a quarter of each head by
default) and experts with a sigmoid-gated shared expert (Qwen2-MoE's). Qwen3.5's multimodal checkpoints
(ForConditionalGeneration) keep the text model's keys in text_config; only the text model runs."""

from backend.layer_spec import DENSE, MOE_SOFTMAX_TOPK, AttentionSpec, DeltaNetShape, LayerSpec, MLPSpec
from backend.model_config import ModelConfig, ModelLoadError, base_config, rotary_dim_of

_QWEN35 = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
ARCHITECTURES = ("Qwen3NextForCausalLM", *_QWEN35)
DEFAULT_ROTARY_FACTOR = 0.25  # these configs' own default when they name none


def from_hf(cfg: dict, arch: str, source: str) -> ModelConfig:
    if arch == "Qwen3_5MoeForConditionalGeneration":
        cfg = _text_config(cfg, source)
    mc = base_config(cfg, arch, source)
    mc.qkv_bias = mc.o_bias = bool(cfg.get("attention_bias", False))
    mc.norm_unit_offset = True
    params = cfg.get("rope_parameters") or {}
    if "partial_rotary_factor" not in params and "partial_rotary_factor" not in cfg:
        cfg = {**cfg, "partial_rotary_factor": DEFAULT_ROTARY_FACTOR}
    mc.rotary_dim = rotary_dim_of(cfg, mc.head_dim, source)
    mc.num_experts = cfg.get("num_experts") or 0
    if mc.num_experts:
        mc.num_experts_per_tok = cfg["num_experts_per_tok"]
        mc.moe_intermediate_size = cfg["moe_intermediate_size"]
        # Qwen3.5's router always renormalises its top k
        mc.norm_topk_prob = True if arch in _QWEN35 else bool(cfg.get("norm_topk_prob", True))
        mc.shared_expert_intermediate_size = cfg.get("shared_expert_intermediate_size") or 0
    linear = DeltaNetShape(
        num_key_heads=cfg.get("linear_num_key_heads", 16),
        num_value_heads=cfg.get("linear_num_value_heads", 32),
        key_head_dim=cfg.get("linear_key_head_dim", 128),
        value_head_dim=cfg.get("linear_value_head_dim", 128),
        conv_kernel=cfg.get("linear_conv_kernel_dim", 4),
    )
    if linear.num_value_heads % linear.num_key_heads:
        raise ModelLoadError(
            f"{source}: linear_num_value_heads={linear.num_value_heads} is not a multiple of "
            f"linear_num_key_heads={linear.num_key_heads}"
        )
    types = _layer_types(cfg, source)
    mc.layers = tuple(
        LayerSpec(_attention(types[i], linear), _mlp(cfg, arch, i)) for i in range(mc.num_layers)
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


def _layer_types(cfg: dict, source: str) -> list[str]:
    """Each layer's kind: config.json's layer_types, else every full_attention_interval-th layer full (4)."""
    layers = cfg["num_hidden_layers"]
    interval = cfg.get("full_attention_interval") or 4
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)
    ]
    if len(types) != layers or set(types) - {"linear_attention", "full_attention"}:
        raise ModelLoadError(
            f"{source}: layer_types must name linear_attention or full_attention for each of "
            f"{layers} layers, got {types}"
        )
    return types


def _attention(kind: str, linear: DeltaNetShape) -> AttentionSpec:
    if kind == "linear_attention":
        return AttentionSpec("linear", linear=linear)
    return AttentionSpec("full", qk_norm="head", output_gate=True)


def _mlp(cfg: dict, arch: str, i: int) -> MLPSpec:
    """Qwen3.5-MoE: experts in every layer; Qwen3-Next: Qwen2-MoE's decoder_sparse_step and mlp_only_layers."""
    if not cfg.get("num_experts"):
        return DENSE
    if arch in _QWEN35:
        return MOE_SOFTMAX_TOPK
    step = cfg.get("decoder_sparse_step", 1) or 1
    sparse = i not in (cfg.get("mlp_only_layers") or []) and (i + 1) % step == 0
    return MOE_SOFTMAX_TOPK if sparse else DENSE
