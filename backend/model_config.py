"""One description of a model's shape, read from a Hugging Face config.json or from GGUF metadata."""

import math
from dataclasses import dataclass, field

from backend.layer_spec import DENSE, MOE_SOFTMAX_TOPK, AttentionSpec, LayerSpec, attention_of

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "SmolLM3ForCausalLM",
                           "Phi3ForCausalLM", "OlmoeForCausalLM", "GraniteMoeForCausalLM",
                           "GraniteMoeSharedForCausalLM", "Gemma3ForCausalLM")
_GRANITE_MOE = ("GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the gated MLP's: SiLU (most), GELU's tanh approximation (Gemma)


class ModelLoadError(Exception):
    pass


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    layers: tuple[LayerSpec, ...] = ()  # one a layer: its attention and feed-forward kinds (layer_spec.py)
    rotary_dim: int = 0  # the leading dimensions of each head that rotate (Phi's partial rotary); 0: head_dim
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear" | "yarn" | "longrope", ...}
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    # Mixture of experts (num_experts == 0: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = True  # Qwen2-MoE's sigmoid gate on the shared expert; Granite-MoE adds it ungated
    # Granite's scalars (1.0 elsewhere): the embeddings multiplied, each residual branch multiplied before it is
    # added, the logits divided; attention_scale, where set, in place of head_dim ** -0.5
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_scale: float | None = None
    # Gemma's: norms that scale by (1 + weight) in fp32, a norm on each branch's output before it is added and
    # one before the MLP (the sandwich), the embedding multiplier rounded to the compute dtype before it
    # multiplies, and the logits' tanh softcap (None: none)
    hidden_act: str = "silu"  # one of ACTIVATIONS
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    embedding_multiplier_in_dtype: bool = False
    final_logit_softcap: float | None = None

    def __post_init__(self):
        self.rotary_dim = self.rotary_dim or self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def _rope(cfg: dict, source: str) -> tuple[float, dict | None]:
    # transformers 5 writes `rope_parameters` (theta inside); older checkpoints `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or {})
    theta = params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
    params.pop("partial_rotary_factor", None)  # how many dimensions rotate, not how (ModelConfig.rotary_dim)
    scaling = params or dict(cfg.get("rope_scaling") or {})
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "su":  # Phi-3's first name for it
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"{source}: rope scaling {rope_type!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return float(theta), None
    scaling["rope_type"] = rope_type
    if rope_type == "yarn":
        # Qwen's and DeepSeek's configs may keep the trained length outside rope_scaling, or leave it implicit.
        scaling.setdefault("original_max_position_embeddings",
                           cfg.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 4096))
        if scaling.get("factor") is None:
            scaling["factor"] = cfg.get("max_position_embeddings", 4096) / scaling["original_max_position_embeddings"]
    if rope_type == "longrope":
        return float(theta), _longrope(cfg, scaling, source)
    return float(theta), scaling


def _longrope(cfg: dict, scaling: dict, source: str) -> dict:
    """Phi-3/Phi-4's LongRoPE: per-frequency divisors, short_factor within the trained length and long_factor past
    it (`long`: which one, set by context_length.fit_context from max_model_len), and cos/sin scaled by
    sqrt(1 + ln(factor) / ln(trained)) (transformers' and the paper's default)."""
    longest = cfg.get("max_position_embeddings", 4096)
    trained = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings") or longest
    if not scaling.get("short_factor") or not scaling.get("long_factor"):
        raise ModelLoadError(f"{source}: rope scaling 'longrope' needs both short_factor and long_factor")
    factor = scaling.get("factor") or longest / trained
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(trained))
    return {"rope_type": "longrope", "short_factor": [float(f) for f in scaling["short_factor"]],
            "long_factor": [float(f) for f in scaling["long_factor"]], "original_max_position_embeddings": int(trained),
            "attention_factor": float(attention), "long": False}


def as_id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def from_hf_config(cfg: dict, source: str) -> ModelConfig:
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(f"{source}: architecture {', '.join(archs) or '(none given)'} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"  # Gemma's key, everyone else's
    if act not in ACTIVATIONS:
        raise ModelLoadError(f"{source}: hidden activation {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    if cfg.get("use_sliding_window") and arch != "SmolLM3ForCausalLM":
        raise ModelLoadError(f"{source}: use_sliding_window=true (Qwen's per-layer windows) is not supported")
    heads = cfg["num_attention_heads"]
    theta, scaling = _rope(_gemma3_global_rope(cfg) if arch == "Gemma3ForCausalLM" else cfg, source)
    mc = ModelConfig(
        architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg.get("intermediate_size", 0), num_layers=cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), eos_token_ids=as_id_list(cfg.get("eos_token_id")),
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"), hidden_act=act)
    if arch in ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "SmolLM3ForCausalLM",
                "OlmoeForCausalLM", "Gemma3ForCausalLM", *_GRANITE_MOE):
        mc.qkv_bias = mc.o_bias = bool(cfg.get("attention_bias", False))
        mc.mlp_bias = bool(cfg.get("mlp_bias", False))
    if arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
        mc.qkv_bias = True  # Qwen2 always has q/k/v biases and none on o_proj
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        mc.qkv_bias = bool(cfg.get("attention_bias", False))
        mc.o_bias = mc.qkv_bias
    if arch == "Phi3ForCausalLM":
        mc.rotary_dim = _rotary_dim(cfg, mc.head_dim, source)
    if arch == "MixtralForCausalLM":
        mc.num_experts = cfg["num_local_experts"]
        mc.num_experts_per_tok = cfg["num_experts_per_tok"]
        mc.moe_intermediate_size = mc.intermediate_size
        mc.norm_topk_prob = True  # Mixtral always renormalises its top-k weights
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        mc.num_experts = cfg.get("num_experts") or cfg["num_local_experts"]  # transformers 5 writes the latter
        mc.num_experts_per_tok = cfg["num_experts_per_tok"]
        mc.moe_intermediate_size = cfg["moe_intermediate_size"]
        mc.norm_topk_prob = bool(cfg.get("norm_topk_prob", False))
    if arch == "OlmoeForCausalLM":
        if cfg.get("clip_qkv") is not None:
            raise ModelLoadError(f"{source}: clip_qkv (OLMoE's clamped q/k/v) is not supported")
        mc.num_experts = cfg.get("num_experts") or cfg["num_local_experts"]
        mc.num_experts_per_tok = cfg["num_experts_per_tok"]
        mc.moe_intermediate_size = mc.intermediate_size  # OLMoE's experts are its only feed-forward
        mc.norm_topk_prob = bool(cfg.get("norm_topk_prob", False))
    if arch in _GRANITE_MOE:
        _granite_moe(mc, cfg)
    if arch == "Gemma3ForCausalLM":
        _gemma3(mc, cfg, source)
    if arch == "Qwen2MoeForCausalLM":
        mc.shared_expert_intermediate_size = cfg.get("shared_expert_intermediate_size", 0)
    mc.layers = tuple(_hf_layer(arch, cfg, i, source) for i in range(mc.num_layers))
    return mc


def _hf_layer(arch: str, cfg: dict, i: int, source: str) -> LayerSpec:
    """Layer i's kinds, from the family's own way of saying them."""
    window, rope = None, True
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        window = cfg.get("sliding_window")  # one window for every layer, or none
    if arch == "SmolLM3ForCausalLM":
        rope = _smollm3_rope(cfg, source)[i]
        if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
            types = cfg.get("layer_types") or ["full_attention" if r else "sliding_attention"
                                               for r in _smollm3_rope(cfg, source)]
            window = cfg["sliding_window"] if types[i] == "sliding_attention" else None
    if arch == "Gemma3ForCausalLM":
        return LayerSpec(_gemma3_attention(cfg, i, source), DENSE)
    qk_norm = {"Qwen3ForCausalLM": "head", "Qwen3MoeForCausalLM": "head", "OlmoeForCausalLM": "full"}.get(arch)
    attention = attention_of(window, rope=rope, qk_norm=qk_norm)
    if arch in ("MixtralForCausalLM", "OlmoeForCausalLM", *_GRANITE_MOE):
        return LayerSpec(attention, MOE_SOFTMAX_TOPK)
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        step = cfg.get("decoder_sparse_step", 1) or 1
        sparse = i not in (cfg.get("mlp_only_layers") or []) and (i + 1) % step == 0
        return LayerSpec(attention, MOE_SOFTMAX_TOPK if sparse else DENSE)
    return LayerSpec(attention, DENSE)


def _granite_moe(mc: ModelConfig, cfg: dict) -> None:
    """Granite-MoE's experts (its router's softmax over the top-k logits is softmax_topk renormalised), its ungated
    shared expert (GraniteMoeShared), and its four scalars."""
    mc.num_experts = cfg.get("num_local_experts") or cfg["num_experts"]
    mc.num_experts_per_tok = cfg["num_experts_per_tok"]
    mc.moe_intermediate_size = mc.intermediate_size
    mc.norm_topk_prob = True
    mc.shared_expert_intermediate_size = cfg.get("shared_intermediate_size") or 0
    mc.shared_expert_gated = False
    mc.embedding_multiplier = float(cfg.get("embedding_multiplier", 1.0))
    mc.residual_multiplier = float(cfg.get("residual_multiplier", 1.0))
    mc.logits_scaling = float(cfg.get("logits_scaling", 1.0))
    mc.attention_scale = float(cfg.get("attention_multiplier", mc.head_dim ** -0.5))


def _gemma3(mc: ModelConfig, cfg: dict, source: str) -> None:
    """Gemma 3's norms, embedding scale, attention scale and logits softcap (its layers: _gemma3_attention)."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(f"{source}: attn_logit_softcapping (a tanh cap on attention scores) is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: use_bidirectional_attention (Gemma's encoder use) is not supported")
    mc.norm_unit_offset = mc.sandwich_norms = mc.embedding_multiplier_in_dtype = True
    mc.embedding_multiplier = mc.hidden_size ** 0.5
    mc.attention_scale = float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5
    cap = cfg.get("final_logit_softcapping")
    mc.final_logit_softcap = float(cap) if cap is not None else None


def _gemma3_types(cfg: dict) -> list[str]:
    """Each layer's type: config.json's layer_types, else every `sliding_window_pattern`-th layer full (6)."""
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
    return cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                      for i in range(cfg["num_hidden_layers"])]


def _gemma3_global_rope(cfg: dict) -> dict:
    """The config as _rope reads it for the full-attention layers: transformers 5 keeps one rope_parameters per
    layer type; older files a rope_theta (1M when absent) and rope_scaling for them."""
    params = (cfg.get("rope_parameters") or {}).get("full_attention")
    if params is not None:
        return {**cfg, "rope_parameters": params}
    return {**cfg, "rope_parameters": None, "rope_theta": cfg.get("rope_theta") or 1_000_000.0}


def _gemma3_attention(cfg: dict, i: int, source: str) -> AttentionSpec:
    """Sliding layers rotate with their own unscaled base (rope_local_base_freq, 10k); full layers with the
    model's rope_theta and scaling. Every layer norms q and k per head."""
    types = _gemma3_types(cfg)
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


def _smollm3_rope(cfg: dict, source: str) -> list[bool]:
    """Whether each layer rotates: config.json's `no_rope_layers` (1: rotates, 0: a NoPE layer, despite the name),
    else every `no_rope_layer_interval`-th layer (4 by default) is NoPE."""
    layers = cfg["num_hidden_layers"]
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = cfg.get("no_rope_layer_interval") or 4
        return [(i + 1) % interval != 0 for i in range(layers)]
    if len(flags) != layers:
        raise ModelLoadError(f"{source}: no_rope_layers has {len(flags)} entries for {layers} layers")
    return [bool(f) for f in flags]


def _rotary_dim(cfg: dict, head_dim: int, source: str) -> int:
    factor = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise ModelLoadError(f"{source}: partial_rotary_factor {factor} rotates {dim} of {head_dim} dimensions a "
                             "head; rotary needs an even number, at least 2")
    return dim
