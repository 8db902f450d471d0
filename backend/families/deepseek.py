"""DeepSeek-V2/V3 (multi-head latent attention; the V2 softmax routers, V3's sigmoid router with its selection
bias; shared experts; the first layers dense) and GLM-4.5 (V3's router and experts over plain grouped-query
attention with partial rotary, q/k norms per head and q/k/v biases).

YaRN as DeepSeek's configs define it: the rotary table scaled by mscale / mscale_all_dim (rotary.attention_factor)
and the softmax scale multiplied by mscale_all_dim's mscale squared, as transformers' yarn_apply_mscale does."""

import math

from backend.layer_spec import DENSE, AttentionSpec, LayerSpec, MLAShape, MLPSpec, attention_of
from backend.model_config import (
    ModelConfig,
    ModelLoadError,
    base_config,
    config_float,
    config_int,
    rotary_dim_of,
)

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")
# DeepSeek's topk_method -> our router
_V2_ROUTERS = {"greedy": "softmax_topk", "group_limited_greedy": "group_limited"}


def from_hf(cfg: dict, arch: str, source: str) -> ModelConfig:
    method = (cfg.get("quantization_config") or {}).get("quant_method")
    if method is not None:  # DeepSeek-V3's and Kimi's own checkpoints: fp8 blocks with their scales
        raise ModelLoadError(
            f"{source}: quantization_config {method!r} is not supported; use a bf16 checkpoint "
            "or a GGUF of it"
        )
    mc = base_config(cfg, arch, source)
    mc.num_experts = config_int(cfg, _experts_key(cfg), source, 0, minimum=0)
    if mc.num_experts:
        mc.num_experts_per_tok = config_int(cfg, "num_experts_per_tok", source)
        mc.moe_intermediate_size = config_int(cfg, "moe_intermediate_size", source)
        if mc.num_experts_per_tok > mc.num_experts:
            raise ModelLoadError(
                f"{source}: num_experts_per_tok={mc.num_experts_per_tok} is more than the "
                f"{mc.num_experts} experts"
            )
    shared = config_int(cfg, "n_shared_experts", source, 0, minimum=0)
    mc.shared_expert_intermediate_size = shared * mc.moe_intermediate_size
    mc.shared_expert_gated = False  # added as it is
    # V2's routers never renormalise (as transformers' DeepseekV2TopkRouter); V3's and GLM's where the config says
    mc.norm_topk_prob = arch != "DeepseekV2ForCausalLM" and bool(cfg.get("norm_topk_prob", False))
    mlp = _moe_spec(cfg, arch, source)
    if arch == "Glm4MoeForCausalLM":
        mc.qkv_bias = bool(cfg.get("attention_bias", False))  # q/k/v only: GLM's o_proj has none
        mc.rotary_dim = rotary_dim_of(cfg, mc.head_dim, source)
        attention = attention_of(None, qk_norm="head" if cfg.get("use_qk_norm") else None)
    else:
        attention = _mla(cfg, arch, mc, source)
    first_sparse = config_int(cfg, "first_k_dense_replace", source, 0, minimum=0)
    freq = config_int(cfg, "moe_layer_freq", source, 1)
    layers = []
    for i in range(mc.num_layers):
        sparse = mlp is not None and i >= first_sparse and i % freq == 0
        layers.append(LayerSpec(attention, mlp if sparse else DENSE))
    mc.layers = tuple(layers)
    return mc


def _experts_key(cfg: dict) -> str:
    """DeepSeek's n_routed_experts, or num_local_experts as some of its descendants spell it."""
    return "n_routed_experts" if cfg.get("n_routed_experts") is not None else "num_local_experts"


def _mla(cfg: dict, arch: str, mc: ModelConfig, source: str) -> AttentionSpec:
    shape = MLAShape(
        q_lora_rank=config_int(cfg, "q_lora_rank", source, 0, minimum=0)
        or None,  # 0 or null: q in one projection
        kv_lora_rank=config_int(cfg, "kv_lora_rank", source),
        qk_nope_head_dim=config_int(cfg, "qk_nope_head_dim", source),
        qk_rope_head_dim=config_int(cfg, "qk_rope_head_dim", source),
        v_head_dim=config_int(cfg, "v_head_dim", source),
        rope_interleaved=arch == "DeepseekV2ForCausalLM" or cfg.get("rope_interleave", True) is not False,
    )
    if shape.qk_rope_head_dim % 2:
        raise ModelLoadError(
            f"{source}: qk_rope_head_dim {shape.qk_rope_head_dim} is odd; rotary needs pairs"
        )
    mc.qkv_bias = mc.o_bias = bool(cfg.get("attention_bias", False))  # q_a, kv_a and o projections
    mc.head_dim = shape.qk_nope_head_dim + shape.qk_rope_head_dim  # q . k's width (its 1/sqrt is the scale)
    mc.rotary_dim = shape.qk_rope_head_dim
    mc.num_kv_heads = 1  # one latent row a token, shared by every head
    mc.attention_scale = mc.head_dim**-0.5 * _mscale_all_dim(mc.rope_scaling) ** 2
    return AttentionSpec("mla", mla=shape)


def _mscale_all_dim(scaling: dict | None) -> float:
    """YaRN's mscale for every dimension of q . k (DeepSeek's mscale_all_dim): 1 without YaRN or without the key."""
    if scaling is None or scaling["rope_type"] != "yarn" or not scaling.get("mscale_all_dim"):
        return 1.0
    factor = scaling["factor"]
    return 1.0 if factor <= 1 else 0.1 * scaling["mscale_all_dim"] * math.log(factor) + 1.0


def _moe_spec(cfg: dict, arch: str, source: str) -> MLPSpec | None:
    """The sparse layers' router, or None for a model without routed experts."""
    experts = config_int(cfg, _experts_key(cfg), source, 0, minimum=0)
    if not experts:
        return None
    groups = dict(
        n_group=config_int(cfg, "n_group", source, 1),
        topk_group=config_int(cfg, "topk_group", source, 1),
        routed_scaling_factor=config_float(cfg, "routed_scaling_factor", source, 1.0, positive=True),
    )
    if arch == "DeepseekV2ForCausalLM":
        method = cfg.get("topk_method") or "greedy"
        if method not in _V2_ROUTERS:
            raise ModelLoadError(
                f"{source}: topk_method {method!r} is not supported for DeepSeek-V2; supported: "
                f"{', '.join(_V2_ROUTERS)}"
            )
        router = _V2_ROUTERS[method]
    else:  # V3 and GLM-4.5: sigmoid scores, e_score_correction_bias for the choice (topk_method noaux_tc)
        scoring = cfg.get("scoring_func") or "sigmoid"
        if scoring != "sigmoid":
            raise ModelLoadError(
                f"{source}: scoring_func {scoring!r} is not supported for {arch}; it routes by sigmoid scores"
            )
        router = "sigmoid_bias"
    if router != "softmax_topk" and (experts % groups["n_group"] or groups["topk_group"] > groups["n_group"]):
        raise ModelLoadError(
            f"{source}: {experts} experts in n_group={groups['n_group']} groups, topk_group="
            f"{groups['topk_group']}: the groups must split the experts evenly and be at least "
            "topk_group"
        )
    return MLPSpec("moe", router, **groups)


# llama.cpp's layouts of these families (its convert_hf_to_gguf.py): deepseek2 (V2, V3, Moonlight, Kimi) with kv_b
# as one attn_kv_b or split in attn_k_b (transposed) and attn_v_b; glm4moe with its MTP layer after the others
GGUF_LAYOUTS = ("deepseek2", "glm4moe")
_SIGMOID = 2  # gguf-py's ExpertGatingFuncType (1: softmax, the default)


def from_gguf(mc: ModelConfig, arch: str, field, tensors: dict) -> None:
    """Completes gguf_config's generic reading of a deepseek2 or glm4moe file: the kinds of every layer, the
    routers, the latent attention's widths (from the tensors' shapes, which both kv_b layouts agree on)."""
    mc.num_layers -= int(field(f"{arch}.nextn_predict_layers", 0) or 0)  # GLM's MTP layers: kept, not run
    sigmoid = int(field(f"{arch}.expert_gating_func", 1) or 1) == _SIGMOID
    groups = dict(
        n_group=int(field(f"{arch}.expert_group_count", 1) or 1),
        topk_group=int(field(f"{arch}.expert_group_used_count", 1) or 1),
        routed_scaling_factor=float(field(f"{arch}.expert_weights_scale", 1.0) or 1.0),
    )
    router = "sigmoid_bias" if sigmoid else "group_limited" if groups["n_group"] > 1 else "softmax_topk"
    mlp = MLPSpec("moe", router, **groups) if mc.num_experts else None
    mc.norm_topk_prob = bool(field(f"{arch}.expert_weights_norm", False))
    shared = int(field(f"{arch}.expert_shared_count", 0) or 0)
    if shared and not mc.shared_expert_intermediate_size:
        mc.shared_expert_intermediate_size = shared * mc.moe_intermediate_size
    mc.shared_expert_gated = False
    if arch == "glm4moe":
        mc.architecture = "Glm4MoeForCausalLM"
        attention = attention_of(None, qk_norm="head" if "blk.0.attn_q_norm.weight" in tensors else None)
    else:
        mc.architecture = "DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"
        attention = _gguf_mla(mc, arch, field, tensors)
    dense = int(field(f"{arch}.leading_dense_block_count", 0) or 0)
    mc.layers = tuple(
        LayerSpec(attention, mlp if mlp is not None and i >= dense else DENSE) for i in range(mc.num_layers)
    )


def _gguf_mla(mc: ModelConfig, arch: str, field, tensors: dict) -> AttentionSpec:
    heads, rope = mc.num_heads, int(field(f"{arch}.rope.dimension_count"))
    q = tensors["blk.0.attn_q_b.weight" if "blk.0.attn_q_b.weight" in tensors else "blk.0.attn_q.weight"]
    qk_head_dim = int(q.shape[1]) // heads  # ggml's shapes: columns first
    q_lora = int(field(f"{arch}.attention.q_lora_rank")) if "blk.0.attn_q_a.weight" in tensors else None
    shape = MLAShape(
        q_lora_rank=q_lora,
        kv_lora_rank=int(tensors["blk.0.attn_kv_a_norm.weight"].shape[0]),
        qk_nope_head_dim=qk_head_dim - rope,
        qk_rope_head_dim=rope,
        v_head_dim=int(tensors["blk.0.attn_output.weight"].shape[0]) // heads,
    )
    mc.qkv_bias = "blk.0.attn_kv_a_mqa.bias" in tensors
    mc.o_bias = "blk.0.attn_output.bias" in tensors
    mc.head_dim, mc.rotary_dim, mc.num_kv_heads = qk_head_dim, rope, 1
    log_multiplier = field(f"{arch}.rope.scaling.yarn_log_multiplier")
    if mc.rope_scaling is not None and mc.rope_scaling["rope_type"] == "yarn" and log_multiplier:
        # the converter writes 0.1 * mscale_all_dim; DeepSeek's configs give mscale the same value
        mscale = float(log_multiplier) / 0.1
        mc.rope_scaling.update(mscale=mscale, mscale_all_dim=mscale)
    mc.attention_scale = qk_head_dim**-0.5 * _mscale_all_dim(mc.rope_scaling) ** 2
    return AttentionSpec("mla", mla=shape)


def kv_b_from_split(k_b, v_b):
    """attn_k_b [heads, kv_lora, nope] and attn_v_b [heads, v, kv_lora] (numpy, as gguf-py reads them) as the
    kv_b_proj weight [heads * (nope + v), kv_lora] they were split from."""
    import numpy as np

    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, k_b.shape[1])


def beyond_layers(name: str, mc: ModelConfig) -> bool:
    """Whether a checkpoint tensor belongs to a layer past the model's last: the multi-token prediction layers
    (num_nextn_predict_layers) DeepSeek-V3's and GLM-4.5's checkpoints keep after the others, which we do not run."""
    if mc.architecture not in ARCHITECTURES or not name.startswith("model.layers."):
        return False
    index = name.split(".")[2]
    return index.isdigit() and int(index) >= mc.num_layers
