"""One description of a model's shape, and what every family's config reader shares: the rotary settings, the
common keys of a Hugging Face config.json. The readers: hf_config.py (by architecture) and gguf_config.py."""

import math
from dataclasses import dataclass, field

from backend.layer_spec import LayerSpec

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_ROPE_NUMBERS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "beta_fast",
                 "beta_slow", "mscale", "mscale_all_dim", "attention_factor")
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
    # Where RoPE switches by length (context_length.fit_context): a sequence of at most rope_switch_length tokens
    # rotates by short_rope_scaling (the model as its file has it), a longer one by rope_scaling; None: no switch
    rope_switch_length: int | None = None
    short_rope_scaling: dict | None = None
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


def rope_params(cfg: dict, source: str) -> tuple[float, dict | None]:
    # transformers 5 writes `rope_parameters` (theta inside); older checkpoints `rope_theta` + `rope_scaling`.
    for key in ("rope_parameters", "rope_scaling"):
        if not isinstance(cfg.get(key) or {}, dict):
            raise ModelLoadError(f"{source}: {key} is {cfg[key]!r}; it must be an object of rope settings")
    params = dict(cfg.get("rope_parameters") or {})
    theta = params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
    theta = config_float({"rope_theta": theta}, "rope_theta", source, positive=True)
    params.pop("partial_rotary_factor", None)  # how many dimensions rotate, not how (ModelConfig.rotary_dim)
    scaling = params or dict(cfg.get("rope_scaling") or {})
    for key in _ROPE_NUMBERS:
        config_float(scaling, key, f"{source} (rope scaling)", None)
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


_REQUIRED = object()


def config_int(cfg: dict, key: str, source: str, default=_REQUIRED, minimum: int = 1) -> int:
    """config.json's integer `key`, at least `minimum`; `default` where it is absent or null (none: required)."""
    value = cfg.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ModelLoadError(f"{source}: {key} is missing; config.json needs an integer of at least {minimum} there")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ModelLoadError(f"{source}: {key} is {value!r}; it must be an integer of at least {minimum}")
    return value


def config_float(cfg: dict, key: str, source: str, default=_REQUIRED, positive: bool = False) -> float:
    """config.json's number `key` (above 0 where `positive`); `default` where it is absent or null."""
    value = cfg.get(key)
    if value is None and default is not _REQUIRED:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and value <= 0):
        raise ModelLoadError(f"{source}: {key} is {value!r}; it must be a number{' above 0' if positive else ''}")
    return float(value)


def config_list(cfg: dict, key: str, source: str) -> list | None:
    """config.json's list `key`, or None where it is absent or null."""
    value = cfg.get(key)
    if value is not None and not isinstance(value, list):
        raise ModelLoadError(f"{source}: {key} is {value!r}; it must be a list")
    return value


def layer_types(cfg: dict, source: str, kinds: tuple[str, ...], layers: int, default: list[str]) -> list[str]:
    """config.json's layer_types (`default` where absent): one of `kinds` for each of the `layers` layers."""
    types = config_list(cfg, "layer_types", source) or default
    if len(types) != layers or not all(isinstance(t, str) and t in kinds for t in types):
        raise ModelLoadError(f"{source}: layer_types must name {' or '.join(kinds)} for each of {layers} layers, "
                             f"got {types}")
    return types


def as_id_list(value, source: str = "generation_config.json", key: str = "eos_token_id") -> list[int]:
    if value is None:
        return []
    ids = list(value) if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ids):
        raise ModelLoadError(f"{source}: {key} is {value!r}; it must be a token id or a list of them")
    return ids


def base_config(cfg: dict, arch: str, source: str) -> ModelConfig:
    """The keys every family's config.json spells alike; a family's reader sets the rest."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"  # Gemma's key, everyone else's
    if act not in ACTIVATIONS:
        raise ModelLoadError(f"{source}: hidden activation {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    hidden, heads = config_int(cfg, "hidden_size", source), config_int(cfg, "num_attention_heads", source)
    longest = config_int(cfg, "max_position_embeddings", source, 4096)  # before rope_params reads it
    kv_heads = config_int(cfg, "num_key_value_heads", source, heads)
    if heads % kv_heads:
        raise ModelLoadError(f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    theta, scaling = rope_params(cfg, source)
    return ModelConfig(
        architecture=arch, vocab_size=config_int(cfg, "vocab_size", source), hidden_size=hidden,
        intermediate_size=config_int(cfg, "intermediate_size", source, 0, minimum=0),
        num_layers=config_int(cfg, "num_hidden_layers", source), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=config_int(cfg, "head_dim", source, hidden // heads),
        rms_norm_eps=config_float(cfg, "rms_norm_eps", source, 1e-6, positive=True), rope_theta=theta,
        rope_scaling=scaling, max_position_embeddings=longest,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        eos_token_ids=as_id_list(cfg.get("eos_token_id"), source), torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        hidden_act=act)


def rotary_dim_of(cfg: dict, head_dim: int, source: str) -> int:
    factor = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0
    factor = config_float({"partial_rotary_factor": factor}, "partial_rotary_factor", source, positive=True)
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2 or dim > head_dim:
        raise ModelLoadError(f"{source}: partial_rotary_factor {factor} rotates {dim} of {head_dim} dimensions a "
                             "head; rotary needs an even number, at least 2 and at most all of them")
    return dim
