"""One description of a model's shape, read from a Hugging Face config.json or from GGUF metadata."""

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear" | "yarn", ...}
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before rotary
    sliding_window: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    # Mixture of experts (num_experts == 0: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_moe(self, layer: int) -> bool:
        return self.is_moe and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


def _rope(cfg: dict) -> tuple[float, dict | None]:
    # transformers 5 writes `rope_parameters` (theta inside); older checkpoints `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or {})
    theta = params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
    scaling = params or dict(cfg.get("rope_scaling") or {})
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"rope scaling {rope_type!r} is not supported; supported: "
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
    return float(theta), scaling


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
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported (only silu)")
    if cfg.get("use_sliding_window"):
        raise ModelLoadError(f"{source}: use_sliding_window=true (Qwen's per-layer windows) is not supported")
    heads = cfg["num_attention_heads"]
    theta, scaling = _rope(cfg)
    mc = ModelConfig(
        architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg.get("intermediate_size", 0), num_layers=cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), eos_token_ids=as_id_list(cfg.get("eos_token_id")),
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"))
    if arch in ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"):
        mc.qkv_bias = mc.o_bias = bool(cfg.get("attention_bias", False))
        mc.mlp_bias = bool(cfg.get("mlp_bias", False))
    if arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
        mc.qkv_bias = True  # Qwen2 always has q/k/v biases and none on o_proj
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        mc.qkv_bias = bool(cfg.get("attention_bias", False))
        mc.o_bias = mc.qkv_bias
        mc.qk_norm = True
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        mc.sliding_window = cfg.get("sliding_window")
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
        mc.decoder_sparse_step = cfg.get("decoder_sparse_step", 1) or 1
        mc.mlp_only_layers = list(cfg.get("mlp_only_layers") or [])
    if arch == "Qwen2MoeForCausalLM":
        mc.shared_expert_intermediate_size = cfg.get("shared_expert_intermediate_size", 0)
    return mc
