"""gpt-oss (GptOssForCausalLM): sliding-window (128) and full attention layers in turn, every layer with learned
attention sinks, biases on q/k/v/o, YaRN; every feed-forward a MoE whose router has a bias and softmaxes its top-k
logits, and whose experts have biases and the clamped SwiGLU. Its checkpoints' tensors: gpt_oss_weights.py."""

from backend.layer_spec import LayerSpec, MLPSpec, attention_of
from backend.model_config import (
    ModelConfig,
    ModelLoadError,
    base_config,
    config_float,
    config_int,
    layer_types,
)

ARCHITECTURES = ("GptOssForCausalLM",)
_KINDS = ("sliding_attention", "full_attention")


def from_hf(cfg: dict, arch: str, source: str) -> ModelConfig:
    mc = base_config(cfg, arch, source)
    mc.qkv_bias = mc.o_bias = bool(cfg.get("attention_bias", True))
    mc.num_experts = config_int(cfg, "num_local_experts", source)
    mc.num_experts_per_tok = config_int(cfg, "num_experts_per_tok", source)
    if mc.num_experts_per_tok > mc.num_experts:
        raise ModelLoadError(
            f"{source}: num_experts_per_tok={mc.num_experts_per_tok} is more than the {mc.num_experts} experts"
        )
    mc.moe_intermediate_size = mc.intermediate_size
    # A softmax over the top-k logits is softmax_topk's softmax over all of them, top k kept and renormalised
    mc.norm_topk_prob = True
    mlp = MLPSpec(
        "moe",
        "softmax_topk",
        bias=True,
        clamped_swiglu=(
            config_float(cfg, "swiglu_alpha", source, 1.702),
            config_float(cfg, "swiglu_limit", source, 7.0, positive=True),
        ),
    )
    types = layer_types(cfg, source, _KINDS, mc.num_layers, [_KINDS[i % 2] for i in range(mc.num_layers)])
    window = config_int(cfg, "sliding_window", source, 128)
    mc.layers = tuple(
        LayerSpec(attention_of(window if kind == "sliding_attention" else None, sinks=True), mlp)
        for kind in types
    )
    return mc
