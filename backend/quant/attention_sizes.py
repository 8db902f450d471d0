"""The bytes of one decoder layer's attention, by its kind (layer_spec.AttentionSpec): grouped-query attention,
DeepSeek's latent attention and the Gated DeltaNet's linear attention. `fmt(kind)` names the format a GGUF tensor kind
is held in (weight_sizes' recipes); norms, biases and the other small tensors are counted as fp32, as weight_sizes
counts every norm."""

from collections.abc import Callable

from backend.layer_spec import AttentionSpec, DeltaNetShape, MLAShape
from backend.model_config import ModelConfig
from backend.quant.formats import BY_NAME, row_bytes

FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}


def tensor_bytes(fmt: str, rows: int, cols: int) -> int:
    """Bytes of a [rows, cols] weight stored in a GGUF format."""
    if fmt in FLOAT_BYTES:
        return rows * cols * FLOAT_BYTES[fmt]
    return rows * row_bytes(BY_NAME[fmt], cols)


def attention_bytes(cfg: ModelConfig, spec: AttentionSpec, fmt: Callable[[str], str]) -> int:
    """One layer's attention weights, its own norms included (q/k norms, sinks, biases)."""
    if spec.kind == "mla":
        return _latent_bytes(cfg, spec.mla, fmt)
    if spec.kind == "linear":
        return _linear_bytes(cfg, spec.linear, fmt)
    h, heads, kv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q_rows = heads * d * (2 if spec.output_gate else 1)  # the output gate's rows follow q's (Qwen3-Next)
    total = tensor_bytes(fmt("attn_q"), q_rows, h) + tensor_bytes(fmt("attn_k"), kv * d, h)
    total += tensor_bytes(fmt("attn_v"), kv * d, h) + tensor_bytes(fmt("attn_output"), h, heads * d)
    # q/k norms: a head's width each, or all of q and all of k
    total += {"head": 2 * 4 * d, "full": 4 * (heads + kv) * d}.get(spec.qk_norm, 0)
    if cfg.qkv_bias:
        total += 4 * (heads + 2 * kv) * d
    if cfg.o_bias:
        total += 4 * h
    return total + (4 * heads if spec.sinks else 0)


def _latent_bytes(cfg: ModelConfig, m: MLAShape, fmt) -> int:
    """DeepSeek's latent attention's projections and norms (models/mla.py); kv_b as one tensor, which every loader
    holds as floats (a GGUF's attn_kv_b, or its attn_k_b and attn_v_b, are dequantized at load): the recipe's
    format for it is the float one of the file's other tensors or the compute dtype's, never a quantized one."""
    h, heads, qk = cfg.hidden_size, cfg.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim
    if m.q_lora_rank:
        q = tensor_bytes(fmt("attn_q_a"), m.q_lora_rank, h) + 4 * m.q_lora_rank
        q += tensor_bytes(fmt("attn_q_b"), heads * qk, m.q_lora_rank)
    else:
        q = tensor_bytes(fmt("attn_q"), heads * qk, h)
    kv = tensor_bytes(fmt("attn_kv_a_mqa"), m.kv_lora_rank + m.qk_rope_head_dim, h) + 4 * m.kv_lora_rank
    kv += tensor_bytes(fmt("attn_kv_b"), heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
    if cfg.qkv_bias:  # on the projections from the hidden state: q_a (or none on a plain q) and kv_a
        kv += 4 * ((m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_rope_head_dim)
    total = q + kv + tensor_bytes(fmt("attn_output"), h, heads * m.v_head_dim)
    return total + (4 * h if cfg.o_bias else 0)


def _linear_bytes(cfg: ModelConfig, s: DeltaNetShape, fmt) -> int:
    """The Gated DeltaNet layer (models/gated_deltanet.py), under llama.cpp's tensor kinds: q|k|v (attn_qkv) and z
    (attn_gate) into in_proj_qkvz, b (ssm_beta) and a (ssm_alpha) into in_proj_ba, out_proj (ssm_out); and its small
    floats: the depthwise convolution (ssm_conv1d), dt_bias (ssm_dt), A_log (ssm_a) and the gated norm (ssm_norm)."""
    h = cfg.hidden_size
    keys, values = s.num_key_heads * s.key_head_dim, s.num_value_heads * s.value_head_dim
    conv = 2 * keys + values  # the channels the convolution runs over: q, k and v
    total = tensor_bytes(fmt("attn_qkv"), conv, h) + tensor_bytes(fmt("attn_gate"), values, h)
    total += sum(tensor_bytes(fmt(kind), s.num_value_heads, h) for kind in ("ssm_beta", "ssm_alpha"))
    total += tensor_bytes(fmt("ssm_out"), h, values)
    return total + 4 * (conv * s.conv_kernel + 2 * s.num_value_heads + s.value_head_dim)
