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


# llama.cpp's layout of gpt-oss (convert_hf_to_gguf.py's GptOssModel): gate and up experts as two stacks (the
# checkpoint's interleaved rows split) or, with its fuse_gate_up_exps, one ffn_gate_up_exps stack of gate's rows then
# up's (its bias likewise), MXFP4 kept as its blocks (GGML type 39), sinks as attn_sinks.weight.
GGUF_LAYOUTS = ("gpt-oss",)
# its tensors that gguf_load's shared table does not name (the expert stacks' biases: gpt_oss_weights.as_ours)
GGUF_TENSORS = {
    "attn_sinks": "self_attn.sinks",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate_exps": "mlp.ffn_gate_exps",
    "ffn_up_exps": "mlp.ffn_up_exps",
    "ffn_down_exps": "mlp.ffn_down_exps",
    "ffn_gate_up_exps": "mlp.ffn_gate_up_exps",
}
# No key carries the clamped SwiGLU's alpha and limit: llama.cpp's graph (llama-graph.cpp, LLM_FFN_SWIGLU_OAI_MOE)
# hard-codes gpt-oss's 1.702 and 7.0.
_GGUF_SWIGLU = (1.702, 7.0)


def from_gguf(mc: ModelConfig, arch: str, field, tensors: dict) -> None:
    """Completes gguf_config's generic reading of a gpt-oss file: the layers' kinds, the router and experts."""
    mc.architecture = ARCHITECTURES[0]
    # llama.cpp's softmax over the top-k logits (LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT)
    mc.norm_topk_prob = True
    mlp = MLPSpec("moe", "softmax_topk", bias=True, clamped_swiglu=_GGUF_SWIGLU)
    window = int(field(f"{arch}.attention.sliding_window", 128))
    # llama.cpp's set_swa_pattern(2): layer i slides where i % 2 == 0, as gpt-oss's layer_types alternate
    mc.layers = tuple(
        LayerSpec(attention_of(window if i % 2 == 0 else None, sinks=True), mlp) for i in range(mc.num_layers)
    )
    if mc.rope_scaling is not None and mc.rope_scaling["rope_type"] == "yarn":
        # gpt-oss's YaRN keeps its correction range unrounded (config.json's truncate: false); no key says so
        mc.rope_scaling["truncate"] = False
