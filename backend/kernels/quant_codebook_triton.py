"""GGUF's codebook and ternary formats (IQ*, MXFP4, TQ*) read in their own blocks inside Triton kernels.

`codebook_weights` decodes 256 columns of BLOCK_N rows into fp32 weights, each the torch reference's product q *
scale (backend/quant/codebooks.py: the same scale arithmetic in the same order, so each weight is the same float),
for the block-wise kernels of quant_gemv_triton.py. The grids, sign patterns and 4-bit tables these formats index
are gguf-py's, laid end to end in one small byte tensor per device (`codebook_tables`): every kernel takes its
pointer, so a MoE layer whose gate and up are different codebooks needs no second argument. A grid entry is read
a weight at a time; the tables (34 KiB) stay in the GPU's caches.
"""

import functools

import torch
import triton
import triton.language as tl

from backend.kernels.gguf_bytes_triton import byte_at, f16_at, f16_masked
from backend.quant.codebooks import grid_values, sign_patterns, table_values
from backend.quant.formats import FORMATS

# GGML type ids decoded here; every other format the kernels read has an id below 16
CODEBOOK_FORMATS = (16, 17, 18, 19, 20, 21, 22, 23, 29, 34, 35, 39)

# (what, entries, values an entry) in the order they lie in the tables
_TABLES = (
    ("signs", 128, 8),
    ("IQ4_NL", 16, 1),
    ("MXFP4", 16, 1),
    ("IQ2_XXS", 256, 8),
    ("IQ2_XS", 512, 8),
    ("IQ2_S", 1024, 8),
    ("IQ3_XXS", 256, 4),
    ("IQ3_S", 512, 4),
    ("IQ1_S", 2048, 8),
)
_STARTS = {}
_at = 0
for _name, _entries, _width in _TABLES:
    _STARTS[_name] = _at
    _at += _entries * _width
SIGNS = tl.constexpr(_STARTS["signs"])
IQ4_NL = tl.constexpr(_STARTS["IQ4_NL"])
MXFP4 = tl.constexpr(_STARTS["MXFP4"])
IQ2_XXS = tl.constexpr(_STARTS["IQ2_XXS"])
IQ2_XS = tl.constexpr(_STARTS["IQ2_XS"])
IQ2_S = tl.constexpr(_STARTS["IQ2_S"])
IQ3_XXS = tl.constexpr(_STARTS["IQ3_XXS"])
IQ3_S = tl.constexpr(_STARTS["IQ3_S"])
IQ1 = tl.constexpr(_STARTS["IQ1_S"])  # IQ1_M indexes the same grid
# A block's bytes, indexed by GGML type id (formats.py's table; 0 for the ids it does not name)
BLOCK_BYTES = tl.constexpr(
    tuple(FORMATS[t].block_bytes if t in FORMATS else 0 for t in range(max(FORMATS) + 1))
)


@functools.cache
def codebook_tables(device: torch.device) -> torch.Tensor:
    """gguf-py's grids, sign patterns (+-1 a weight) and 4-bit tables as int8 values stored in uint8, on device."""
    from gguf import quants

    parts = []
    for name, entries, width in _TABLES:
        if name == "signs":
            part = sign_patterns(torch.device("cpu"))
        elif name in ("IQ4_NL", "MXFP4"):
            part = table_values(name, torch.device("cpu"))
        else:
            part = grid_values(name, torch.device("cpu"))
            if tuple(getattr(quants, name).grid_shape) != (entries, width):
                raise RuntimeError(
                    f"gguf-py's {name} grid is {getattr(quants, name).grid_shape}, not the "
                    f"({entries}, {width}) the Triton kernels index; update quant_codebook_triton"
                )
        parts.append(part.reshape(-1))
    return torch.cat(parts).view(torch.uint8).to(device)


@triton.jit
def _value(tab_ptr, at):
    """A table's int8 value(s) at `at` (offsets into codebook_tables), as fp32."""
    return tl.load(tab_ptr + at).to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def _u16(ptr):
    return byte_at(ptr) | (byte_at(ptr + 1) << 8)


@triton.jit
def _nibble_blocks(w_ptr, row_off, kb, K, tab_ptr, FMT: tl.constexpr, BLOCK_N: tl.constexpr):
    """IQ4_NL (d, 16 bytes) and MXFP4 (e8m0, 16 bytes): 8 blocks of 32 columns; byte v % 16 of a block holds its
    column v (low nibble, v < 16) and v + 16 (high), an index into the format's 16 values."""
    u = tl.arange(0, 8)
    v = tl.arange(0, 32)
    used = kb * 256 + u * 32 < K
    blk = w_ptr + row_off[:, None] + (kb * 8 + u)[None, :] * BLOCK_BYTES[FMT]  # [BLOCK_N, 8]
    byte = tl.load(
        blk[:, :, None] + (2 if FMT == 20 else 1) + (v % 16)[None, None, :], mask=used[None, :, None], other=0
    ).to(tl.int32)
    q = _value(tab_ptr, (IQ4_NL if FMT == 20 else MXFP4) + ((byte >> (4 * (v // 16))[None, None, :]) & 15))
    if FMT == 20:
        scale = f16_masked(blk, used[None, :])
    else:  # 2^(e - 128) as gguf-py reads e8m0: the fp32 bits (e - 1) << 23, subnormal below e = 2
        e = tl.load(blk, mask=used[None, :], other=0).to(tl.int32)
        scale = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
    return tl.reshape(scale[:, :, None] * q, (BLOCK_N, 256))


@triton.jit
def _groups_of_32(blk, tab_ptr, FMT: tl.constexpr, BLOCK_N: tl.constexpr):
    """The 256-blocks whose scales (or sign and delta words) go by 32 columns: IQ4_XS, IQ2_XXS, IQ3_XXS, IQ3_S,
    IQ1_S, TQ1_0, TQ2_0. blk: [BLOCK_N] block pointers -> q [BLOCK_N, 8, 32], scale [BLOCK_N, 8] (fp32)."""
    s1 = tl.arange(0, 8)
    s = s1[None, :, None]
    v = tl.arange(0, 32)[None, None, :]
    b3 = blk[:, None, None]
    b2 = blk[:, None]
    if FMT == 23:  # IQ4_XS: d, 16 high-bit pairs, 4 bytes of low nibbles, then 16 bytes of nibbles a group
        high = (_u16(blk + 2)[:, None] >> (2 * s1[None, :])) & 3
        low = (byte_at(b2 + 4 + s1[None, :] // 2) >> (4 * (s1[None, :] % 2))) & 15
        scale = f16_at(blk)[:, None] * ((low | (high << 4)) - 32).to(tl.float32)
        q = _value(tab_ptr, IQ4_NL + ((byte_at(b3 + 8 + 16 * s + v % 16) >> (4 * (v // 16))) & 15))
    elif FMT == 16 or FMT == 18:
        # IQ2_XXS, IQ3_XXS: grid indices, and a word per group: 4 sign indices, scale
        aux_at = b2 + (6 + 8 * s1[None, :] if FMT == 16 else 66 + 4 * s1[None, :])  # [BLOCK_N, 8]
        aux = _u16(aux_at) | (_u16(aux_at + 2) << 16)
        scale = (
            f16_at(blk)[:, None]
            * (0.5 + (byte_at(aux_at + 3) >> 4).to(tl.float32))
            * (0.25 if FMT == 16 else 0.5)
        )
        sign_index = (aux[:, :, None] >> (7 * (v // 8))) & 127
        sign = _value(tab_ptr, SIGNS + sign_index * 8 + v % 8)
        if FMT == 16:
            grid = _value(tab_ptr, IQ2_XXS + byte_at(b3 + 2 + 8 * s + v // 8) * 8 + v % 8)
        else:
            grid = _value(tab_ptr, IQ3_XXS + byte_at(b3 + 2 + 8 * s + v // 4) * 4 + v % 4)
        q = grid * sign
    elif FMT == 21:  # IQ3_S: index low bytes, their 9th bits, sign bits, 4-bit scales (1 + 2 sc)
        u = 8 * s + v // 4  # the weight's grid entry
        index = byte_at(b3 + 2 + u) | (((byte_at(b3 + 66 + u // 8) >> (u % 8)) & 1) << 8)
        negative = (byte_at(b3 + 74 + 4 * s + v // 8) >> (v % 8)) & 1
        q = _value(tab_ptr, IQ3_S + index * 4 + v % 4) * (1 - 2 * negative).to(tl.float32)
        sc = (byte_at(b2 + 106 + s1[None, :] // 2) >> (4 * (s1[None, :] % 2))) & 15
        scale = f16_at(blk)[:, None] * (1 + 2 * sc).to(tl.float32)
    elif FMT == 19:
        # IQ1_S: index low bytes, a word a group: 3 high bits an entry, a 3-bit scale, the delta's sign
        qh = _u16(b2 + 34 + 2 * s1[None, :])  # [BLOCK_N, 8]
        index = byte_at(b3 + 2 + 4 * s + v // 8) | (((qh[:, :, None] >> (3 * (v // 8))) & 7) << 8)
        delta = (1 - 2 * (qh >> 15))[:, :, None]
        q = (
            8 * tl.load(tab_ptr + IQ1 + index * 8 + v % 8).to(tl.int8, bitcast=True).to(tl.int32) + delta
        ).to(tl.float32)
        scale = f16_at(blk)[:, None] * (2 * ((qh >> 12) & 7) + 1).to(tl.float32) * 0.125
    elif FMT == 35:  # TQ2_0: 2-bit digits (byte 32c + l, shift 2f: column 128c + 32f + l), then d
        q = ((byte_at(b3 + 32 * (s // 4) + v) >> (2 * (s % 4))) & 3) - 1
        q = q.to(tl.float32)
        scale = tl.broadcast_to(f16_at(blk + 64)[:, None], (BLOCK_N, 8))
    else:  # TQ1_0: five base-3 digits a byte (four in the last 4), each the byte's fraction times 3 once shifted up
        tl.static_assert(FMT == 34)
        w = 32 * s + v
        at = tl.where(w < 160, w % 32, tl.where(w < 240, 32 + (w - 160) % 16, 48 + (w - 240) % 4))
        p = tl.where(w < 160, w // 32, tl.where(w < 240, (w - 160) // 16, (w - 240) // 4))
        power = tl.where(p == 0, 1, tl.where(p == 1, 3, tl.where(p == 2, 9, tl.where(p == 3, 27, 81))))
        q = ((((byte_at(b3 + at) * power) & 255) * 3) >> 8) - 1
        q = q.to(tl.float32)
        scale = tl.broadcast_to(f16_at(blk + 52)[:, None], (BLOCK_N, 8))
    return q, scale


@triton.jit
def _groups_of_16(blk, tab_ptr, FMT: tl.constexpr, BLOCK_N: tl.constexpr):
    """The 256-blocks with a scale a 16 columns: IQ2_XS, IQ2_S, IQ1_M -> q [BLOCK_N, 16, 16], scale [BLOCK_N, 16]."""
    s1 = tl.arange(0, 16)
    s = s1[None, :, None]
    v = tl.arange(0, 16)[None, None, :]
    b3 = blk[:, None, None]
    b2 = blk[:, None]
    u = 2 * s + v // 8  # the weight's grid entry (8 weights each)
    if FMT == 17 or FMT == 22:
        if FMT == 17:  # IQ2_XS: a 16-bit word an entry: 9-bit grid index, 7-bit sign index
            word = _u16(b3 + 2 + 2 * u)
            q = _value(tab_ptr, IQ2_XS + (word & 511) * 8 + v % 8) * _value(
                tab_ptr, SIGNS + (word >> 9) * 8 + v % 8
            )
            at = 66
        else:  # IQ2_S: index low bytes, sign bits, 2 high index bits an entry
            index = byte_at(b3 + 2 + u) | (((byte_at(b3 + 66 + u // 4) >> (2 * (u % 4))) & 3) << 8)
            negative = (byte_at(b3 + 34 + u) >> (v % 8)) & 1
            q = _value(tab_ptr, IQ2_S + index * 8 + v % 8) * (1 - 2 * negative).to(tl.float32)
            at = 74
        sc = (byte_at(b2 + at + s1[None, :] // 2) >> (4 * (s1[None, :] % 2))) & 15
        scale = f16_at(blk)[:, None] * (0.5 + sc.to(tl.float32)) * 0.25
    else:  # IQ1_M: index low bytes, a nibble an entry (3 high bits, the delta's sign), 4 words of 3-bit scales
        tl.static_assert(FMT == 29)
        nib = (byte_at(b3 + 32 + u // 2) >> (4 * (u % 2))) & 15
        index = byte_at(b3 + u) | ((nib & 7) << 8)
        q = (
            8 * tl.load(tab_ptr + IQ1 + index * 8 + v % 8).to(tl.int8, bitcast=True).to(tl.int32)
            + 1
            - 2 * (nib >> 3)
        ).to(tl.float32)
        w4 = tl.arange(0, 4)
        # d's bits are the top nibbles of the four words [BLOCK_N, 4], the first word's lowest
        words = _u16(b2 + 48 + 2 * w4[None, :])
        d = tl.sum((words >> 12) << (4 * w4[None, :]), axis=1).to(tl.uint16).to(tl.float16, bitcast=True)
        sc = (_u16(b2 + 48 + 2 * (s1[None, :] // 4)) >> (3 * (s1[None, :] % 4))) & 7
        scale = d.to(tl.float32)[:, None] * (2 * sc + 1).to(tl.float32) * 0.125
    return q, scale


@triton.jit
def codebook_weights(w_ptr, row_off, kb, K, tab_ptr, FMT: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_N, 256] fp32 weights of columns kb*256 .. kb*256+255 of the rows at row_off (byte offsets), each the
    reference's q * scale; K masks the 32-blocks past a row's end (the 256-blocks fill whole tiles)."""
    if FMT == 20 or FMT == 39:
        w = _nibble_blocks(w_ptr, row_off, kb, K, tab_ptr, FMT, BLOCK_N)
    else:
        blk = w_ptr + row_off + kb * BLOCK_BYTES[FMT]  # the rows' kb-th 256-blocks
        if FMT == 17 or FMT == 22 or FMT == 29:
            q, scale = _groups_of_16(blk, tab_ptr, FMT, BLOCK_N)
        else:
            q, scale = _groups_of_32(blk, tab_ptr, FMT, BLOCK_N)
        w = tl.reshape(q * scale[:, :, None], (BLOCK_N, 256))
    return w
