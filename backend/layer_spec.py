"""What each decoder layer computes: its attention kind and its feed-forward kind.

A family's config reader (model_config.py, gguf_config.py) builds one LayerSpec a layer, once; the decoder
(models/transformer.py) builds each layer from its own spec, and the CPU's one-call step (models/cpu_decoder.py)
reads the same spec. DESIGN.md, "Layer kinds and cache groups": each attention kind says what it keeps a token
in the paged cache (block_shapes) and what it keeps a sequence outside it (a linear layer's recurrent state).
"""

from dataclasses import dataclass

# full and sliding: paged keys and values; mla: paged compressed latent and the decoupled rotary key (DeepSeek's
# multi-head latent attention); linear: no paged cache, a recurrent state a sequence (Gated DeltaNet)
ATTENTION_KINDS = ("full", "sliding", "mla", "linear")
# head: RMSNorm over each head of q and of k (Qwen3); full: over the whole projected q and the whole k (OLMoE)
QK_NORMS = ("head", "full")
MLP_KINDS = ("dense", "moe")
# softmax_topk: softmax over the experts' logits, the top k taken (renormalised where the model says)
# group_limited: softmax scores, the top k taken within the topk_group best of n_group expert groups (DeepSeek-V2);
# sigmoid_bias: sigmoid scores, chosen by score + e_score_correction_bias within groups, weighted by the
# unbiased scores (DeepSeek-V3, GLM-4.5)
ROUTERS = ("softmax_topk", "group_limited", "sigmoid_bias")


@dataclass(frozen=True)
class MLAShape:
    """Multi-head latent attention's widths (DeepSeek-V2/V3's config names)."""
    q_lora_rank: int | None  # None: q is one plain projection
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # the rotary key's and query's dimensions rotate in adjacent pairs (DeepSeek's checkpoints, llama.cpp's
    # deepseek2), not as the two halves of the rotary part
    rope_interleaved: bool = True


@dataclass(frozen=True)
class DeltaNetShape:
    """A Gated DeltaNet layer's widths (Qwen3-Next's and Qwen3.5's config names, linear_*)."""
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    # q|k|v|z and b|a come out of the projections grouped by key head (Qwen3-Next's checkpoints), not each apart
    grouped_projections: bool = False
    # value head h reads key head h % num_key_heads (llama.cpp's qwen35moe files: its converter tiles the value
    # heads), not h // (num_value_heads / num_key_heads) (the checkpoints' order)
    tiled_value_heads: bool = False


@dataclass(frozen=True)
class AttentionSpec:
    kind: str = "full"
    window: int | None = None  # sliding: how many positions a query attends to, its own included
    rope: bool = True  # False: a NoPE layer, whose q and k are not rotated (SmolLM3's every fourth layer)
    sinks: bool = False  # a learned logit a query head in each of its softmaxes' denominators (gpt-oss)
    qk_norm: str | None = None  # one of QK_NORMS: q and k RMS-normed before rotary; None: not normed
    # this layer's own rotary base, unscaled (Gemma 3's local layers); None: the model's rope_theta and rope_scaling
    rope_theta: float | None = None
    mla: MLAShape | None = None  # the mla kind's widths
    linear: DeltaNetShape | None = None  # the linear kind's widths
    output_gate: bool = False  # a sigmoid gate on the attention's output, from q's projection (Qwen3-Next)

    def __post_init__(self):
        if self.kind not in ATTENTION_KINDS:
            raise ValueError(f"attention kind {self.kind!r} is not one of {', '.join(ATTENTION_KINDS)}")
        if (self.kind == "sliding") != (self.window is not None):
            raise ValueError(
                f"{self.kind} attention with window={self.window}: only sliding attention has a window"
            )
        if self.qk_norm is not None and self.qk_norm not in QK_NORMS:
            raise ValueError(f"q/k norm {self.qk_norm!r} is not one of {', '.join(QK_NORMS)}")
        if self.rope_theta is not None and not self.rope:
            raise ValueError(
                f"a NoPE layer with rope_theta={self.rope_theta}: only a rotating layer has a base"
            )
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window of {self.window} tokens: it must be at least 1")
        if (self.kind == "mla") != (self.mla is not None) or (self.kind == "linear") != (self.linear is not None):
            raise ValueError(f"{self.kind} attention with mla={self.mla}, linear={self.linear}: an mla layer has "
                             "its MLAShape, a linear layer its DeltaNetShape, other kinds neither")

    def block_shapes(self, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[tuple, tuple]:
        """The shapes of one block of this layer's paged cache: keys, then values."""
        if self.kind == "mla":  # one latent row a token: the compressed kv, then the rotary key; no values apart
            return (block_size, 1, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim), (block_size, 0)
        if self.kind == "linear":
            return (0,), (0,)
        return (block_size, num_kv_heads, head_dim), (block_size, num_kv_heads, head_dim)


@dataclass(frozen=True)
class MLPSpec:
    kind: str = "dense"
    router: str | None = None  # moe: how each token picks its experts
    # group_limited and sigmoid_bias routers: experts in n_group groups, tokens routed within the best topk_group
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # the routed experts' weights multiplied by it (DeepSeek, GLM)
    bias: bool = False  # biases on the router's logits and on each expert's projections (gpt-oss)
    # the experts' activation: None, silu(gate) * up; (alpha, limit), gpt-oss's clamped SwiGLU:
    # gate * sigmoid(alpha * gate) * (up + 1), gate clamped to at most limit and up to [-limit, limit]
    clamped_swiglu: tuple[float, float] | None = None

    def __post_init__(self):
        if self.kind not in MLP_KINDS:
            raise ValueError(f"MLP kind {self.kind!r} is not one of {', '.join(MLP_KINDS)}")
        if (self.kind == "moe") != (self.router is not None) or (self.router and self.router not in ROUTERS):
            raise ValueError(
                f"{self.kind} MLP with router {self.router!r}: a MoE layer names one of "
                f"{', '.join(ROUTERS)}, a dense layer none"
            )


@dataclass(frozen=True)
class LayerSpec:
    attention: AttentionSpec
    mlp: MLPSpec


def attention_of(window: int | None = None, **flags) -> AttentionSpec:
    """Full attention, or sliding where a window is given (a config's `sliding_window`, null or absent for none)."""
    return AttentionSpec("sliding" if window else "full", int(window) if window else None, **flags)


DENSE = MLPSpec()
MOE_SOFTMAX_TOPK = MLPSpec("moe", "softmax_topk")
