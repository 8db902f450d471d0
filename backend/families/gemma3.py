"""Gemma 3 (text): 5:1 sliding/full layers with their own rotary bases, q/k norms per head, (1 + w) norms around
each branch, embeddings scaled by sqrt(hidden), query_pre_attn_scalar, GELU-tanh and the logits softcap.

Read from config.json (Gemma3ForCausalLM; the multimodal Gemma3ForConditionalGeneration's text_config, whose text
model alone runs) or from llama.cpp's gemma3 GGUF layout (its convert_hf_to_gguf.py Gemma3Model and llama-model's
gemma3 hyperparameters)."""

from backend.layer_spec import DENSE, AttentionSpec, LayerSpec
from backend.model_config import (
    ModelConfig,
    ModelLoadError,
    base_config,
    config_float,
    config_int,
    layer_types,
)

ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
# Gemma3TextConfig's defaults for the keys the released multimodal configs leave out of text_config
# (google/gemma-3-4b-it names little more than its widths, layer count, window and rope scaling)
_TEXT_DEFAULTS = dict(
    vocab_size=262208,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    rms_norm_eps=1e-6,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    max_position_embeddings=131072,
    tie_word_embeddings=True,
    hidden_activation="gelu_pytorch_tanh",
    eos_token_id=1,
)
GGUF_LAYOUTS = ("gemma3",)
# llama.cpp's gemma3 constants, which no key of the file carries: every sixth layer full, the others sliding and
# rotating with an unscaled base of 10k
_GGUF_PATTERN = 6
_GGUF_LOCAL_BASE = 10_000.0


def from_hf(cfg: dict, arch: str, source: str) -> ModelConfig:
    if arch == "Gemma3ForConditionalGeneration":
        cfg = _text_config(cfg, source)
    cfg = {**_TEXT_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}  # a null key: as if absent
    if cfg.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(
            f"{source}: attn_logit_softcapping (a tanh cap on attention scores) is not supported"
        )
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: use_bidirectional_attention (Gemma's encoder use) is not supported")
    mc = base_config(_global_rope(cfg, source), arch, source)
    mc.qkv_bias = mc.o_bias = bool(cfg.get("attention_bias", False))
    mc.mlp_bias = bool(cfg.get("mlp_bias", False))
    _gemma_pieces(mc)
    mc.attention_scale = config_float(cfg, "query_pre_attn_scalar", source, positive=True) ** -0.5
    mc.final_logit_softcap = config_float(cfg, "final_logit_softcapping", source, None, positive=True)
    types = _types(cfg, mc.num_layers, source)
    mc.layers = tuple(LayerSpec(_attention(cfg, kind, source), DENSE) for kind in types)
    return mc


def _gemma_pieces(mc: ModelConfig) -> None:
    """What config.json and a GGUF file both leave unsaid: the norms, the sandwich, the embedding scale."""
    mc.norm_unit_offset = mc.sandwich_norms = mc.embedding_multiplier_in_dtype = True
    mc.embedding_multiplier = mc.hidden_size**0.5


def _text_config(cfg: dict, source: str) -> dict:
    """A multimodal checkpoint's text model: text_config, with the end tokens given at the top level (the
    releases' [1, 106]: <eos> and <end_of_turn>) and the top level's tying where text_config has none."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(
            f"{source}: a Gemma3ForConditionalGeneration config.json without its text_config"
        )
    merged = dict(text)
    if cfg.get("eos_token_id") is not None:
        merged["eos_token_id"] = cfg["eos_token_id"]
    if merged.get("tie_word_embeddings") is None and cfg.get("tie_word_embeddings") is not None:
        merged["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return merged


def _types(cfg: dict, layers: int, source: str) -> list[str]:
    """Each layer's type: config.json's layer_types, else every `sliding_window_pattern`-th layer full (6)."""
    key = (
        "sliding_window_pattern"
        if cfg.get("sliding_window_pattern") is not None
        else "_sliding_window_pattern"
    )
    pattern = config_int(cfg, key, source, 6)
    every = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    return layer_types(cfg, source, ("sliding_attention", "full_attention"), layers, every)


def _global_rope(cfg: dict, source: str) -> dict:
    """The config as rope_params reads it for the full-attention layers: transformers 5 keeps one rope_parameters
    per layer type; older files a rope_theta (1M when absent) and rope_scaling for them."""
    params = _rope_parameters(cfg, source).get("full_attention")
    if params is not None:
        return {**cfg, "rope_parameters": params}
    return {**cfg, "rope_parameters": None, "rope_theta": cfg.get("rope_theta") or 1_000_000.0}


def _attention(cfg: dict, kind: str, source: str) -> AttentionSpec:
    """Sliding layers rotate with their own unscaled base (rope_local_base_freq, 10k); full layers with the
    model's rope_theta and scaling. Every layer norms q and k per head."""
    if kind == "full_attention":
        return AttentionSpec("full", qk_norm="head")
    local = _rope_parameters(cfg, source).get("sliding_attention") or {}
    if not isinstance(local, dict):
        raise ModelLoadError(
            f"{source}: rope_parameters.sliding_attention is {local!r}; it must be an object"
        )
    if local.get("rope_type", "default") != "default":
        raise ModelLoadError(
            f"{source}: rope scaling {local['rope_type']!r} on sliding layers is not supported"
        )
    theta = local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10_000.0
    theta = config_float({"rope_local_base_freq": theta}, "rope_local_base_freq", source, positive=True)
    return AttentionSpec(
        "sliding", config_int(cfg, "sliding_window", source), qk_norm="head", rope_theta=theta
    )


def _rope_parameters(cfg: dict, source: str) -> dict:
    """transformers 5's rope_parameters: one object of rope settings per layer type."""
    params = cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ModelLoadError(
            f"{source}: rope_parameters is {params!r}; it must be an object of rope settings"
        )
    return params


def from_gguf(mc: ModelConfig, arch: str, field, tensors: dict) -> None:
    """Completes gguf_config's generic reading of a gemma3 file. The converter stores each norm as 1 + w (the
    loader takes the 1 back off: gguf_load.py). No key holds query_pre_attn_scalar: llama.cpp scales q by
    head_dim ** -0.5, and the 27B's (62 layers) by (hidden / heads) ** -0.5, which are the releases' scalars."""
    mc.architecture = "Gemma3ForCausalLM"
    mc.hidden_act = "gelu_pytorch_tanh"
    _gemma_pieces(mc)
    mc.attention_scale = float(mc.hidden_size // mc.num_heads if mc.num_layers == 62 else mc.head_dim) ** -0.5
    cap = field(f"{arch}.final_logit_softcapping")
    mc.final_logit_softcap = float(cap) if cap else None
    window = int(field(f"{arch}.attention.sliding_window", 0) or 0)  # none (or 0): every layer full
    qk_norm = "head" if "blk.0.attn_q_norm.weight" in tensors else None
    full = AttentionSpec("full", qk_norm=qk_norm)
    sliding = (
        AttentionSpec("sliding", window, qk_norm=qk_norm, rope_theta=_GGUF_LOCAL_BASE) if window else full
    )
    mc.layers = tuple(
        LayerSpec(full if (i + 1) % _GGUF_PATTERN == 0 else sliding, DENSE) for i in range(mc.num_layers)
    )
