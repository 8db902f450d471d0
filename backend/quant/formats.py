"""GGUF block formats we compute on, decoded in torch into one affine form shared by every path.

Every supported type reads as w = q * scale + offset per group of `group` weights, with q a small
signed integer: the linear formats' own codes, or for the codebook and ternary ones (codebooks.py) the
grid or table value they index. The operations (and their order) are those of gguf-py's dequantize, so the
torch reference is bit-exact to it; the CPU repacking (cpu_layout.py) keeps the same decomposition.
"""

from dataclasses import dataclass

import torch

from backend.quant.block_bytes import bits, f16, nibbles
from backend.quant.codebooks import decode_codebook, iq4_xs_parts

QK_K = 256


@dataclass(frozen=True)
class Format:
    name: str
    ggml_type: int  # gguf.GGMLQuantizationType value
    block: int  # weights per block
    block_bytes: int
    group: int  # weights sharing one scale (and offset)


FORMATS = {f.ggml_type: f for f in (
    Format("Q4_0", 2, 32, 18, 32),
    Format("Q4_1", 3, 32, 20, 32),
    Format("Q5_0", 6, 32, 22, 32),
    Format("Q5_1", 7, 32, 24, 32),
    Format("Q8_0", 8, 32, 34, 32),
    Format("Q2_K", 10, QK_K, 84, 16),
    Format("Q3_K", 11, QK_K, 110, 16),
    Format("Q4_K", 12, QK_K, 144, 32),
    Format("Q5_K", 13, QK_K, 176, 32),
    Format("Q6_K", 14, QK_K, 210, 16),
    Format("IQ2_XXS", 16, QK_K, 66, 32),
    Format("IQ2_XS", 17, QK_K, 74, 16),
    Format("IQ3_XXS", 18, QK_K, 98, 32),
    Format("IQ1_S", 19, QK_K, 50, 32),
    Format("IQ4_NL", 20, 32, 18, 32),
    Format("IQ3_S", 21, QK_K, 110, 32),
    Format("IQ2_S", 22, QK_K, 82, 16),
    Format("IQ4_XS", 23, QK_K, 136, 32),
    Format("IQ1_M", 29, QK_K, 56, 16),
    Format("TQ1_0", 34, QK_K, 54, 32),
    Format("TQ2_0", 35, QK_K, 66, 32),
    Format("MXFP4", 39, 32, 17, 32),
)}
BY_NAME = {f.name: f for f in FORMATS.values()}
FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}


def row_bytes(fmt: Format, cols: int) -> int:
    if cols % fmt.block:
        raise ValueError(f"{fmt.name} rows hold whole blocks of {fmt.block} weights; a row of {cols} does not")
    return cols // fmt.block * fmt.block_bytes


def _k_scale_min(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> ([n, 8], [n, 8])."""
    d, m, md = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scales = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return scales, mins


def decode(raw: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Blocks [n, block_bytes] uint8 -> q [n, block] int8, scale [n, groups] fp32, offset (or None)."""
    b = raw.reshape(-1, fmt.block_bytes)
    name = fmt.name
    if name == "Q8_0":
        return b[:, 2:].contiguous().view(torch.int8), f16(b[:, 0:2]), None
    if name in ("Q4_0", "Q4_1"):
        d, start = f16(b[:, 0:2]), 2 if name == "Q4_0" else 4
        q = nibbles(b[:, start:], 16).to(torch.int8)
        return (q - 8, d, None) if name == "Q4_0" else (q, d, f16(b[:, 2:4]))
    if name in ("Q5_0", "Q5_1"):
        start = 2 if name == "Q5_0" else 4
        qh = b[:, start:start + 4].contiguous().view(torch.int32)
        high = (qh >> torch.arange(32, dtype=torch.int32, device=b.device)) & 1
        q = (nibbles(b[:, start + 4:], 16) | (high.to(torch.uint8) << 4)).to(torch.int8)
        return (q - 16, f16(b[:, 0:2]), None) if name == "Q5_0" else (q, f16(b[:, 0:2]), f16(b[:, 2:4]))
    parts = decode_parts(b, fmt)
    if parts is not None:
        return composed(parts)
    codebook = decode_codebook(b, name)
    if codebook is None:
        raise ValueError(f"no decoder for {name}")
    return (*codebook, None)


def composed(parts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """decode_parts's result as decode gives it: q, scale d * sc, offset -(dmin * mn) (or None)."""
    q, d, sc, dmin, mn = parts
    return q, d * sc.float(), None if dmin is None else -(dmin * mn.float())


def decode_parts(raw: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, ...] | None:
    """The K-quants' (and IQ4_XS's) blocks [n, block_bytes] -> q [n, 256] int8 and their scales' parts: fp32 d [n, 1] (an fp16 value)
    times small integers sc [n, groups] (the scale, d * sc), and dmin [n, 1] and mn [n, groups] where there is an
    offset (-(dmin * mn)), or None and None; None for the other formats (their scales are fp16 values already)."""
    b = raw.reshape(-1, fmt.block_bytes)
    name = fmt.name
    if name in ("Q4_K", "Q5_K"):
        sc, mn = _k_scale_min(b[:, 4:16])
        if name == "Q4_K":
            q = nibbles(b[:, 16:], 32)
        else:
            q = nibbles(b[:, 48:], 32) | (bits(b[:, 16:48], 8, 1, 32) << 4)
        return q.to(torch.int8), f16(b[:, 0:2]), sc, f16(b[:, 2:4]), mn
    if name == "Q6_K":
        low = nibbles(b[:, 0:128], 64)
        high = bits(b[:, 128:192], 4, 2, 32)
        q = (low | (high << 4)).to(torch.int8) - 32
        return q, f16(b[:, 208:210]), b[:, 192:208].contiguous().view(torch.int8), None, None
    if name == "Q2_K":
        sc = b[:, 0:16]
        q = bits(b[:, 16:80], 4, 2, 32).to(torch.int8)
        return q, f16(b[:, 80:82]), sc & 0xF, f16(b[:, 82:84]), sc >> 4
    if name == "Q3_K":
        sc = b[:, 96:108]
        low = torch.cat([sc[:, 0:8] & 0xF, sc[:, 0:8] >> 4], dim=1)
        high = bits(sc[:, 8:12], 4, 2, 4)
        hbit = bits(b[:, 0:32], 8, 1, 32)
        q = bits(b[:, 32:96], 4, 2, 32).to(torch.int8) - ((hbit ^ 1) << 2).to(torch.int8)
        return q, f16(b[:, 108:110]), (low | (high << 4)).to(torch.int8) - 32, None, None
    if name == "IQ4_XS":
        return iq4_xs_parts(b)
    return None


def dequantize(raw: torch.Tensor, fmt: Format, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of blocks [..., rows, row_bytes] -> weights [..., rows, cols] (fp32 math, then dtype)."""
    lead = raw.shape[:-1]
    q, scale, offset = decode(raw, fmt)
    g = fmt.group
    w = q.view(-1, scale.shape[1], g).float() * scale[:, :, None]
    if offset is not None:
        w = w + offset[:, :, None]
    return w.view(*lead, cols).to(dtype)
