"""The bytes of one decoder layer's attention, by its kind (layer_spec.AttentionSpec): grouped-query attention,
DeepSeek's latent attention and the Gated DeltaNet's linear attention. `fmt(kind)` names the format a GGUF tensor kind
is held in (weight_sizes' recipes); norms, biases and the other small tensors in the float the recipe names for
NORMS, as weight_sizes counts every norm."""

from collections.abc import Callable

from backend.layer_spec import AttentionSpec, DeltaNetShape, MLAShape
from backend.model_config import ModelConfig
from backend.quant.formats import BY_NAME, row_bytes

FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
# Not a GGUF tensor kind: what a recipe names for the small float tensors (norms, biases, attention sinks, the
# routers' selection bias, the linear layers' convolution and gates), which the loader holds in the compute dtype
NORMS = "norms"


def small_float_bytes(fmt: Callable[[str], str]) -> int:
    """Bytes of an element of the small float tensors; fp32 (as GGUF files store them) where a recipe names a
    quantized format for every kind."""
    return FLOAT_BYTES.get(fmt(NORMS), 4)


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
    small = small_float_bytes(fmt)
    q_rows = heads * d * (2 if spec.output_gate else 1)  # the output gate's rows follow q's (Qwen3-Next)
    total = tensor_bytes(fmt("attn_q"), q_rows, h) + tensor_bytes(fmt("attn_k"), kv * d, h)
    total += tensor_bytes(fmt("attn_v"), kv * d, h) + tensor_bytes(fmt("attn_output"), h, heads * d)
    # q/k norms: a head's width each, or all of q and all of k
    total += small * {"head": 2 * d, "full": (heads + kv) * d}.get(spec.qk_norm, 0)
    if cfg.qkv_bias:
        total += small * (heads + 2 * kv) * d
    if cfg.o_bias:
        total += small * h
    return total + (small * heads if spec.sinks else 0)


def _latent_bytes(cfg: ModelConfig, m: MLAShape, fmt) -> int:
    """DeepSeek's latent attention's projections and norms (models/mla.py); kv_b as one tensor, which every loader
    holds as floats (a GGUF's attn_kv_b, or its attn_k_b and attn_v_b, are dequantized at load): the recipe's
    format for it is the float one of the file's other tensors or the compute dtype's, never a quantized one."""
    h, heads, qk = cfg.hidden_size, cfg.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim
    small = small_float_bytes(fmt)
    if m.q_lora_rank:
        q = tensor_bytes(fmt("attn_q_a"), m.q_lora_rank, h) + small * m.q_lora_rank
        q += tensor_bytes(fmt("attn_q_b"), heads * qk, m.q_lora_rank)
    else:
        q = tensor_bytes(fmt("attn_q"), heads * qk, h)
    kv = tensor_bytes(fmt("attn_kv_a_mqa"), m.kv_lora_rank + m.qk_rope_head_dim, h) + small * m.kv_lora_rank
    kv += tensor_bytes(fmt("attn_kv_b"), heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
    if cfg.qkv_bias:  # on the projections from the hidden state: q_a (or none on a plain q) and kv_a
        kv += small * ((m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_rope_head_dim)
    total = q + kv + tensor_bytes(fmt("attn_output"), h, heads * m.v_head_dim)
    return total + (small * h if cfg.o_bias else 0)


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
    return total + small_float_bytes(fmt) * (conv * s.conv_kernel + 2 * s.num_value_heads + s.value_head_dim)


def attention_activation_bytes(cfg: ModelConfig, tokens: int, context: int, itemsize: int) -> int:
    """An upper estimate of what one step of `tokens` tokens allocates in its attention layers (one layer at a time),
    the largest prompt chunk reaching `context` positions: q|k|v a token for grouped-query attention, whose
    kernels read the paged cache in place; the latent attention's own (latent_activation_bytes)."""
    latent = [spec.attention.mla for spec in cfg.layers if spec.attention.kind == "mla"]
    plain = tokens * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * itemsize
    return max([plain, *(latent_activation_bytes(cfg, m, tokens, context, itemsize) for m in latent)])


def latent_activation_bytes(cfg: ModelConfig, m: MLAShape, tokens: int, context: int, itemsize: int) -> int:
    """What a latent attention layer (models/mla.py, kernels/mla_attention.py) allocates for a step of `tokens`,
    at most: per token its q (through the low-rank path's two rows where it has one), the compressed row, the latent
    and its norm, the rotary parts (gathered, reordered, rotated), the row stored, the attention's output, and the
    larger of a decode row's latent-space working set (q through W_UK, with its rotary part, the attended latent,
    the values) and a prompt chunk's q; per position of the largest chunk's context (up to `context`), decompressed:
    the rows gathered from the cache, their keys and values expanded for every head, and the float32 copies (k
    scaled as well) torch's attention makes of them; per query and position, its mask (bool, then in the dtype)
    and, per head, the float32 scores, two copies live at once (torch's fused CPU kernel takes 4-d tensors whose
    values are as wide as the keys; these are 3-d, and V2's values are narrower than its keys (checked on torch 2.13:
    either alone sends a call to the math path), which upcasts, then masks and softmaxes into new tensors)."""
    heads, lora, rope, v = cfg.num_heads, m.kv_lora_rank, m.qk_rope_head_dim, m.v_head_dim
    nope, qk = m.qk_nope_head_dim, m.qk_nope_head_dim + m.qk_rope_head_dim
    chunk = min(tokens, context)  # the one chunk decompressed at a time (chunks run one after another)
    per_token = heads * qk + 2 * (m.q_lora_rank or 0) + (lora + rope) + 2 * lora + 3 * (heads + 1) * rope
    per_token += (lora + rope) + heads * v + max(heads * (3 * lora + rope + v), heads * qk)
    per_position = (lora + rope) + heads * (nope + v) + heads * qk
    upcast = itemsize < 4  # torch's attention copies bf16/fp16 q, k and v to float32 before scaling q and k
    floats = 4 * ((1 + upcast) * heads * qk * (chunk + context) + heads * v * (upcast * context + chunk))
    scores = chunk * context * (1 + itemsize + heads * 2 * 4)
    return (tokens * per_token + context * per_position) * itemsize + floats + scores
