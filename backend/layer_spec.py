"""What each decoder layer computes: its attention kind and its feed-forward kind.

A family's config reader (model_config.py, gguf_config.py) builds one LayerSpec a layer, once; the decoder
(models/transformer.py) builds each layer from its own spec, and the CPU's one-call step (models/cpu_decoder.py)
reads the same spec. DESIGN.md, "Layer kinds and cache groups": later kinds ("mla", "linear" attention; MoE
routers beyond top-k softmax) are new values here, with the KV cache grouped by attention spec.
"""

from dataclasses import dataclass

ATTENTION_KINDS = ("full", "sliding")
# head: RMSNorm over each head of q and of k (Qwen3); full: over the whole projected q and the whole k (OLMoE)
QK_NORMS = ("head", "full")
MLP_KINDS = ("dense", "moe")
# softmax_topk: softmax over the experts' logits, the top k taken (renormalised where the model says)
ROUTERS = ("softmax_topk",)


@dataclass(frozen=True)
class AttentionSpec:
    kind: str = "full"
    window: int | None = None  # sliding: how many positions a query attends to, its own included
    rope: bool = True  # False: a NoPE layer, whose q and k are not rotated (SmolLM3's every fourth layer)
    sinks: bool = False  # learned per-head attention sinks (gpt-oss): described here, not yet computed
    qk_norm: str | None = None  # one of QK_NORMS: q and k RMS-normed before rotary; None: not normed
    # this layer's own rotary base, unscaled (Gemma 3's local layers); None: the model's rope_theta and rope_scaling
    rope_theta: float | None = None

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


@dataclass(frozen=True)
class MLPSpec:
    kind: str = "dense"
    router: str | None = None  # moe: how each token picks its experts

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
