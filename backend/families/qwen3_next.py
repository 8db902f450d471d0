"""Qwen3-Next and Qwen3.5-MoE: Gated DeltaNet linear-attention layers with a gated full-attention layer every
full_attention_interval-th (3:1), (1 + w) RMSNorms, q/k norms per head, partial rotary (a quarter of each head by
default) and experts with a sigmoid-gated shared expert (Qwen2-MoE's). Qwen3.5's multimodal checkpoints
(ForConditionalGeneration) keep the text model's keys in text_config; only the text model runs."""

from backend.layer_spec import DENSE, MOE_SOFTMAX_TOPK, AttentionSpec, DeltaNetShape, LayerSpec, MLPSpec
from backend.model_config import (
    ModelConfig,
    ModelLoadError,
    base_config,
    config_int,
    config_list,
    layer_types,
    rotary_dim_of,
)

_QWEN35 = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
ARCHITECTURES = ("Qwen3NextForCausalLM", *_QWEN35)
DEFAULT_ROTARY_FACTOR = 0.25  # these configs' own default when they name none


def from_hf(cfg: dict, arch: str, source: str) -> ModelConfig:
    if arch == "Qwen3_5MoeForConditionalGeneration":
        cfg = _text_config(cfg, source)
    mc = base_config(cfg, arch, source)
    mc.qkv_bias = mc.o_bias = bool(cfg.get("attention_bias", False))
    mc.norm_unit_offset = True
    params = cfg.get("rope_parameters") or {}  # base_config checked that it is an object
    if "partial_rotary_factor" not in params and "partial_rotary_factor" not in cfg:
        cfg = {**cfg, "partial_rotary_factor": DEFAULT_ROTARY_FACTOR}
    mc.rotary_dim = rotary_dim_of(cfg, mc.head_dim, source)
    mc.num_experts = config_int(cfg, "num_experts", source, 0, minimum=0)
    if mc.num_experts:
        mc.num_experts_per_tok = config_int(cfg, "num_experts_per_tok", source)
        if mc.num_experts_per_tok > mc.num_experts:
            raise ModelLoadError(
                f"{source}: num_experts_per_tok={mc.num_experts_per_tok} is more than the "
                f"{mc.num_experts} experts"
            )
        mc.moe_intermediate_size = config_int(cfg, "moe_intermediate_size", source)
        # Qwen3.5's router always renormalises its top k
        mc.norm_topk_prob = True if arch in _QWEN35 else bool(cfg.get("norm_topk_prob", True))
        mc.shared_expert_intermediate_size = config_int(
            cfg, "shared_expert_intermediate_size", source, 0, minimum=0
        )
    linear = DeltaNetShape(
        num_key_heads=config_int(cfg, "linear_num_key_heads", source, 16),
        num_value_heads=config_int(cfg, "linear_num_value_heads", source, 32),
        key_head_dim=config_int(cfg, "linear_key_head_dim", source, 128),
        value_head_dim=config_int(cfg, "linear_value_head_dim", source, 128),
        conv_kernel=config_int(cfg, "linear_conv_kernel_dim", source, 4),
        grouped_projections=arch not in _QWEN35,
    )
    if linear.num_value_heads % linear.num_key_heads:
        raise ModelLoadError(
            f"{source}: linear_num_value_heads={linear.num_value_heads} is not a multiple of "
            f"linear_num_key_heads={linear.num_key_heads}"
        )
    interval = config_int(cfg, "full_attention_interval", source, 4)
    every = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(mc.num_layers)
    ]
    types = layer_types(cfg, source, ("linear_attention", "full_attention"), mc.num_layers, every)
    mc.layers = tuple(
        LayerSpec(_attention(types[i], linear), _mlp(cfg, arch, i, source)) for i in range(mc.num_layers)
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


def _attention(kind: str, linear: DeltaNetShape) -> AttentionSpec:
    if kind == "linear_attention":
        return AttentionSpec("linear", linear=linear)
    return AttentionSpec("full", qk_norm="head", output_gate=True)


def _mlp(cfg: dict, arch: str, i: int, source: str) -> MLPSpec:
    """Qwen3.5-MoE: experts in every layer; Qwen3-Next: Qwen2-MoE's decoder_sparse_step and mlp_only_layers."""
    if not cfg.get("num_experts"):
        return DENSE
    if arch in _QWEN35:
        return MOE_SOFTMAX_TOPK
    step = config_int(cfg, "decoder_sparse_step", source, 1)
    sparse = i not in (config_list(cfg, "mlp_only_layers", source) or []) and (i + 1) % step == 0
    return MOE_SOFTMAX_TOPK if sparse else DENSE


# llama.cpp's layouts of these families (its converter's Qwen3NextModel and Qwen3_5MoeTextModel). Both write
# q|k|v and z as attn_qkv and attn_gate (older qwen3next files: the checkpoint's grouped in_proj_qkvz as ssm_in),
# -exp(A_log) as ssm_a (no suffix), dt_bias as ssm_dt.bias, the convolution squeezed to [channels, kernel] and every
# (1 + w) norm as 1 + w except the gated norm ssm_norm; qwen3next keeps b|a grouped by key head in ssm_ba, qwen35moe
# writes them apart (ssm_beta, ssm_alpha) with every value-head tensor in tiled order (TILED_LAYOUTS).
GGUF_LAYOUTS = ("qwen3next", "qwen35moe")
TILED_LAYOUTS = ("qwen35moe",)
# llama.cpp's tensor kinds -> ours under model.layers.N (attn_qkv, attn_gate, ssm_beta and ssm_alpha fused at load)
GGUF_TENSORS = {
    "attn_qkv": "self_attn.in_proj_qkv",
    "attn_gate": "self_attn.in_proj_z",
    "ssm_in": "self_attn.in_proj_qkvz",
    "ssm_beta": "self_attn.in_proj_b",
    "ssm_alpha": "self_attn.in_proj_a",
    "ssm_ba": "self_attn.in_proj_ba",
    "ssm_conv1d": "self_attn.conv1d",
    "ssm_norm": "self_attn.norm",
    "ssm_out": "self_attn.out_proj",
    "post_attention_norm": "post_attention_layernorm",
}
# our fused projections' parts (gguf_load's planning): q|k|v then z, b then a
FUSED = {
    ".in_proj_qkv": (".in_proj_qkvz", 0),
    ".in_proj_z": (".in_proj_qkvz", 1),
    ".in_proj_b": (".in_proj_ba", 0),
    ".in_proj_a": (".in_proj_ba", 1),
}
_SCALARS = {"ssm_a": "self_attn.A_log", "ssm_dt": "self_attn.dt_bias"}  # a value a value head, named whole


def gguf_name(kind: str, suffix: str) -> str | None:
    """Our parameter (under model.layers.N.) for one of these layouts' own tensors; None for the common ones."""
    if kind in _SCALARS:
        return _SCALARS[kind]
    return f"{GGUF_TENSORS[kind]}.{suffix}" if kind in GGUF_TENSORS else None


def from_gguf(mc: ModelConfig, arch: str, field, tensors: dict) -> None:
    """Completes gguf_config's generic reading of a qwen3next or qwen35moe file: the linear layers' widths from the
    ssm.* keys as llama.cpp reads them (state_size the key head width, group_count the key heads, time_step_rank
    the value heads, inner_size all value heads' width), each layer's kind from its tensors, the MoE layers'."""
    mc.num_layers -= int(field(f"{arch}.nextn_predict_layers", 0) or 0)  # Qwen3.5's MTP layers: kept, not run
    mc.norm_unit_offset = True
    mc.norm_topk_prob = True  # llama.cpp's graphs of both always renormalise the top k
    value_heads = int(field(f"{arch}.ssm.time_step_rank"))
    linear = DeltaNetShape(
        num_key_heads=int(field(f"{arch}.ssm.group_count")),
        num_value_heads=value_heads,
        key_head_dim=int(field(f"{arch}.ssm.state_size")),
        value_head_dim=int(field(f"{arch}.ssm.inner_size")) // value_heads,
        conv_kernel=int(field(f"{arch}.ssm.conv_kernel")),
        tiled_value_heads=arch in TILED_LAYOUTS,
    )
    if linear.num_value_heads % linear.num_key_heads:
        raise ModelLoadError(
            f"a {arch} GGUF with {linear.num_value_heads} value heads (ssm.time_step_rank) for "
            f"{linear.num_key_heads} key heads (ssm.group_count): not a multiple"
        )
    full = next((i for i in range(mc.num_layers) if f"blk.{i}.attn_q.weight" in tensors), None)
    mc.qkv_bias = full is not None and f"blk.{full}.attn_q.bias" in tensors
    mc.o_bias = full is not None and f"blk.{full}.attn_output.bias" in tensors
    mc.layers = tuple(
        LayerSpec(
            _attention("linear_attention" if f"blk.{i}.ssm_out.weight" in tensors else "full", linear),
            MOE_SOFTMAX_TOPK if f"blk.{i}.ffn_gate_inp.weight" in tensors else DENSE,
        )
        for i in range(mc.num_layers)
    )


def gguf_array(kind: str, data, mc: ModelConfig, layer: int | None):
    """A tensor of these layouts as our layer reads it (numpy; quantized tensors as their rows of blocks): the
    grouped rows of ssm_ba and ssm_in apart (rows move whole, so blocks do too), and the floats the converter
    changed back (A_log, the convolution's shape, the norms' 1 + w)."""
    import numpy as np

    if kind in ("ssm_ba", "ssm_in"):
        shape = mc.layers[layer].attention.linear
        k, per = shape.num_key_heads, shape.num_value_heads // shape.num_key_heads
        parts = (
            [per, per] if kind == "ssm_ba" else [shape.key_head_dim] * 2 + [per * shape.value_head_dim] * 2
        )
        grouped = data.reshape(k, sum(parts), *data.shape[1:])
        bounds = np.cumsum(parts)[:-1]
        return np.concatenate([p.reshape(-1, *data.shape[1:]) for p in np.split(grouped, bounds, axis=1)])
    if kind == "ssm_a":
        return np.log(-data)
    if kind == "ssm_conv1d":
        return data[:, None, :]
    if kind.endswith("norm") and kind != "ssm_norm":
        return data - 1.0
    return data
