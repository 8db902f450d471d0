"""gpt-oss (GptOssForCausalLM): sliding-window (128) and full attention layers in turn, every layer with learned
attention sinks, biases on q/k/v/o, YaRN; every feed-forward a MoE whose router has a bias and softmaxes its top-k
logits, and whose experts have biases and the clamped SwiGLU. Its checkpoints' tensors: gpt_oss_weights.py."""

from backend.layer_spec import LayerSpec, MLPSpec, attention_of
from backend.model_config import ModelConfig, ModelLoadError, base_config

ARCHITECTURES = ("GptOssForCausalLM",)
_KINDS = ("sliding_attention", "full_attention")


def from_hf(cfg: dict, arch: str, source: str) -> ModelConfig:
    mc = base_config(cfg, arch, source)
    mc.qkv_bias = mc.o_bias = bool(cfg.get("attention_bias", True))
    mc.num_experts = cfg["num_local_experts"]
    mc.num_experts_per_tok = cfg["num_experts_per_tok"]
    mc.moe_intermediate_size = mc.intermediate_size
    # A softmax over the top-k logits is softmax_topk's softmax over all of them, top k kept and renormalised
    mc.norm_topk_prob = True
    mlp = MLPSpec(
        "moe",
        "softmax_topk",
        bias=True,
        clamped_swiglu=(float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0))),
    )
    types = cfg.get("layer_types") or [_KINDS[i % 2] for i in range(mc.num_layers)]
    if len(types) != mc.num_layers or set(types) - set(_KINDS):
        raise ModelLoadError(
            f"{source}: layer_types must name sliding_attention or full_attention for each of "
            f"{mc.num_layers} layers, got {types}"
        )
    window = cfg.get("sliding_window") or 128
    mc.layers = tuple(
        LayerSpec(attention_of(window if kind == "sliding_attention" else None, sinks=True), mlp)
        for kind in types
    )
    return mc
