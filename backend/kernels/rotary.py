"""Rotary position embedding in the "rotate half" layout of Hugging Face checkpoints (torch reference)."""

import math
from typing import TYPE_CHECKING

import torch

from backend.kernels import native, use_triton

if TYPE_CHECKING:
    from backend.model_config import ModelConfig


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    # On the CPU whatever the default device: under the loader's meta device the table would be a
    # placeholder computed through torch._refs (whose import costs 1.5 s); the loader replaces it anyway.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "factors":  # a GGUF's rope_freqs tensor: each frequency's divisor, as llama.cpp applies it
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
    if kind == "longrope":  # the set of divisors the engine's length chose (backend/context_length.py)
        factors = scaling["long_factor" if scaling["long"] else "short_factor"]
        return inv_freq / torch.tensor(factors, dtype=torch.float32, device="cpu")
    if kind == "llama3":
        # Llama 3.1's frequency-dependent scaling: long wavelengths divided by `factor`, short ones kept,
        # a smooth interpolation in between.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":
        return _yarn_frequencies(inv_freq, head_dim, theta, scaling)
    raise ValueError(f"rope_type {kind!r} is not supported")


def _yarn_frequencies(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    # YaRN: dimensions that turn fewer than beta_slow times over the trained length are interpolated (divided
    # by factor), those that turn more than beta_fast times are kept, a linear ramp between the two.
    factor, trained = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension(turns: float) -> float:
        return head_dim * math.log(trained / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(fast), dimension(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def attention_factor(scaling: dict | None) -> float:
    """What YaRN and LongRoPE multiply cos and sin by (so q.k by its square): 1 for every other kind."""
    if scaling is not None and scaling["rope_type"] == "longrope":
        return float(scaling["attention_factor"])
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


def cos_sin_table(head_dim: int, theta: float, scaling: dict | None, max_positions: int) -> torch.Tensor:
    """[max_positions, 2, head_dim] in fp32: cos then sin of every position."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling)
    freqs = torch.arange(max_positions, dtype=torch.float32, device="cpu")[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    table = torch.stack([emb.cos(), emb.sin()], dim=1)
    scale = attention_factor(scaling)
    return table if scale == 1.0 else table * scale


def model_cos_sin(cfg: "ModelConfig", max_positions: int, theta: float | None = None) -> torch.Tensor:
    """The model's rotary rows, [rows, 2, rotary_dim] in fp32: every position under its rope_scaling, then, where
    its RoPE switches by length (ModelConfig.rope_switch_length), the positions before the switch under its
    short_rope_scaling, which a sequence within that length reads at an offset (engine/rope_switch.py). theta: a
    layer's own base instead, unscaled in both parts (Gemma 3's local layers)."""
    scaled = cos_sin_table(cfg.rotary_dim, theta or cfg.rope_theta, None if theta else cfg.rope_scaling, max_positions)
    length = cfg.rope_switch_length
    if not length:
        return scaled
    if theta:
        return torch.cat([scaled, scaled[:length]])
    return torch.cat([scaled, cos_sin_table(cfg.rotary_dim, cfg.rope_theta, cfg.short_rope_scaling, length)])


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (heads contiguous: a view of the projection's output will do); cos/sin [T, D] already in x's
    dtype."""
    if use_triton(x):
        from backend.kernels import triton_kernels

        return triton_kernels.apply_rotary(x, cos, sin)
    if (x.stride(2) == 1 and x.stride(1) == x.shape[2] and cos.stride(1) == sin.stride(1) == 1
            and cos.stride(0) == sin.stride(0) and native.usable(x, cos, sin)):
        out = x.new_empty(x.shape)
        native.library().rotary_rows(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], x.shape[2], x.stride(0),
                                     cos.data_ptr(), sin.data_ptr(), cos.stride(0))
        return out
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
