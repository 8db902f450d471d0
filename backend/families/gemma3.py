"""Gemma 3 (text): 5:1 sliding/full layers with their own rotary bases, q/k norms per head, (1 + w) norms around
each branch, embeddings scaled by sqrt(hidden), query_pre_attn_scalar, GELU-tanh and the logits softcap."""

from backend.layer_spec import DENSE, AttentionSpec, LayerSpec
from backend.model_config import ModelConfig, ModelLoadError, base_config

ARCHITECTURES = ("Gemma3ForCausalLM",)


def from_hf(cfg: dict, arch: str, source: str) -> ModelConfig:
    if cfg.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(f"{source}: attn_logit_softcapping (a tanh cap on attention scores) is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: use_bidirectional_attention (Gemma's encoder use) is not supported")
    mc = base_config(_global_rope(cfg), arch, source)
    mc.qkv_bias = mc.o_bias = bool(cfg.get("attention_bias", False))
    mc.mlp_bias = bool(cfg.get("mlp_bias", False))
    mc.norm_unit_offset = mc.sandwich_norms = mc.embedding_multiplier_in_dtype = True
    mc.embedding_multiplier = mc.hidden_size ** 0.5
    mc.attention_scale = float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5
    cap = cfg.get("final_logit_softcapping")
    mc.final_logit_softcap = float(cap) if cap is not None else None
    mc.layers = tuple(LayerSpec(_attention(cfg, i, source), DENSE) for i in range(mc.num_layers))
    return mc


def _types(cfg: dict) -> list[str]:
    """Each layer's type: config.json's layer_types, else every `sliding_window_pattern`-th layer full (6)."""
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
    return cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                      for i in range(cfg["num_hidden_layers"])]


def _global_rope(cfg: dict) -> dict:
    """The config as rope_params reads it for the full-attention layers: transformers 5 keeps one rope_parameters
    per layer type; older files a rope_theta (1M when absent) and rope_scaling for them."""
    params = (cfg.get("rope_parameters") or {}).get("full_attention")
    if params is not None:
        return {**cfg, "rope_parameters": params}
    return {**cfg, "rope_parameters": None, "rope_theta": cfg.get("rope_theta") or 1_000_000.0}


def _attention(cfg: dict, i: int, source: str) -> AttentionSpec:
    """Sliding layers rotate with their own unscaled base (rope_local_base_freq, 10k); full layers with the
    model's rope_theta and scaling. Every layer norms q and k per head."""
    types = _types(cfg)
    if len(types) != cfg["num_hidden_layers"] or set(types) - {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"{source}: layer_types must name sliding_attention or full_attention for each of "
                             f"{cfg['num_hidden_layers']} layers, got {types}")
    if types[i] == "full_attention":
        return AttentionSpec("full", qk_norm="head")
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ModelLoadError(f"{source}: rope scaling {local['rope_type']!r} on sliding layers is not supported")
    theta = local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10_000.0
    return AttentionSpec("sliding", int(cfg["sliding_window"]), qk_norm="head", rope_theta=float(theta))
