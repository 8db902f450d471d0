"""Decode-shaped products over GGUF blocks: a few rows of x against weights read block by block.

quant_triton.dequant_tile decodes any weight at any position, which costs every weight its own scattered byte
loads (scale, minimum, quant): on an H200 the Q4_K Mixtral decoded at 1% of HBM bandwidth through it. Here a
program reads 256 columns of BLOCK_N rows at a time in the file's own order, so the quant bytes arrive as
contiguous vector loads; each sub-block's quants are summed against x first and its scale (and minimum, times
the sub-block's sum of x) applied once per sub-block, as llama.cpp's CUDA kernels do. Formats outside
BLOCK_FORMATS keep the per-weight kernels. The torch reference (dequantize, then a matmul) is the oracle in
tests/backend/test_quant_kernels.py, through the interpreter.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from backend.kernels.gguf_bytes_triton import (
    check_word_aligned,
    f16_at,
    f16_masked,
    k_header,
    k_scale_min_words,
)
from backend.kernels.quant_codebook_triton import CODEBOOK_FORMATS, codebook_tables, codebook_weights

# GGML type ids read here: plain floats, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, and the codebook and ternary formats
# (quant_codebook_triton.py, whose ids are the ones from 16 on).
BLOCK_FORMATS = (0, 2, 3, 8, 12, 13, 14, *CODEBOOK_FORMATS)
GEMM_MAX_ROWS = 64  # past it (a prompt's chunk) the per-weight tiled GEMM, whose tiles reuse weights over 64 rows


@triton.jit
def block_dot(w_ptr, row_off, kb, x_ptr, K, tab_ptr, FMT: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_N] dot products of columns kb*256 .. kb*256+255 of the rows at row_off (byte offsets; element
    offsets for plain floats) with x (one row, K long), in fp32. tab_ptr: codebook_tables, for the codebooks."""
    k0 = kb * 256
    if FMT >= 16:
        k = k0 + tl.arange(0, 256)
        x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        return tl.sum(codebook_weights(w_ptr, row_off, kb, K, tab_ptr, FMT, BLOCK_N) * x[None, :], axis=1)
    elif FMT == 0:
        k = k0 + tl.arange(0, 256)
        w = tl.load(w_ptr + row_off[:, None] + k[None, :], mask=(k < K)[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        return tl.sum(w * x[None, :], axis=1)
    elif FMT == 2 or FMT == 3 or FMT == 8:  # 8 blocks of 32: Q4_0 (d, 16 bytes), Q4_1 (d, m, 16), Q8_0 (d, 32)
        u = tl.arange(0, 8)
        used = k0 + u * 32 < K
        blk = w_ptr + row_off[:, None] + (kb * 8 + u)[None, :] * (18 if FMT == 2 else (20 if FMT == 3 else 34))
        d = f16_masked(blk, used[None, :])  # [BLOCK_N, 8]
        if FMT == 8:
            v = tl.arange(0, 32)
            q = tl.load(blk[:, :, None] + 2 + v[None, None, :], mask=used[None, :, None], other=0)
            x = tl.load(x_ptr + k0 + u[:, None] * 32 + v[None, :], mask=used[:, None], other=0.0).to(tl.float32)
            sums = tl.sum(q.to(tl.int8, bitcast=True).to(tl.float32) * x[None, :, :], axis=2)
            return tl.sum(d * sums, axis=1)
        v = tl.arange(0, 16)
        q = tl.load(blk[:, :, None] + (2 if FMT == 2 else 4) + v[None, None, :], mask=used[None, :, None], other=0).to(tl.int32)
        x_lo = tl.load(x_ptr + k0 + u[:, None] * 32 + v[None, :], mask=used[:, None], other=0.0).to(tl.float32)
        x_hi = tl.load(x_ptr + k0 + u[:, None] * 32 + 16 + v[None, :], mask=used[:, None], other=0.0).to(tl.float32)
        sums = tl.sum((q & 15).to(tl.float32) * x_lo[None, :, :] + (q >> 4).to(tl.float32) * x_hi[None, :, :], axis=2)
        x_sum = tl.sum(x_lo + x_hi, axis=1)  # [8]
        if FMT == 2:
            return tl.sum(d * (sums - 8.0 * x_sum[None, :]), axis=1)
        m = f16_masked(blk + 2, used[None, :])
        return tl.sum(d * sums + m * x_sum[None, :], axis=1)
    elif FMT == 12 or FMT == 13:  # Q4_K: d, dmin, scales[12], qs[128]; Q5_K: the same with qh[32] before qs
        # qs byte 32c + l holds weight 64c + l (low nibble, sub-block 2c) and 64c + 32 + l (high, sub-block 2c+1).
        c = tl.arange(0, 4)
        v = tl.arange(0, 32)
        blk = w_ptr + row_off + kb * (144 if FMT == 12 else 176)  # [BLOCK_N]
        q = tl.load(blk[:, None, None] + (16 if FMT == 12 else 48) + c[None, :, None] * 32 + v[None, None, :]).to(tl.int32)
        lo = q & 15
        hi = q >> 4
        if FMT == 13:
            qh = tl.load(blk[:, None, None] + 16 + v[None, None, :]).to(tl.int32)  # bit s: sub-block s's fifth bit
            lo = lo | (((qh >> (2 * c[None, :, None])) & 1) << 4)
            hi = hi | (((qh >> (2 * c[None, :, None] + 1)) & 1) << 4)
        x_lo = tl.load(x_ptr + k0 + c[:, None] * 64 + v[None, :]).to(tl.float32)
        x_hi = tl.load(x_ptr + k0 + c[:, None] * 64 + 32 + v[None, :]).to(tl.float32)
        s_lo = tl.sum(lo.to(tl.float32) * x_lo[None, :, :], axis=2)  # [BLOCK_N, 4]
        s_hi = tl.sum(hi.to(tl.float32) * x_hi[None, :, :], axis=2)
        d, dmin, a, b, cw = k_header(blk)
        sc_lo, mn_lo = k_scale_min_words(a, b, cw, 2 * c[None, :])
        sc_hi, mn_hi = k_scale_min_words(a, b, cw, 2 * c[None, :] + 1)
        scaled = tl.sum(sc_lo * s_lo + sc_hi * s_hi, axis=1)
        mins = tl.sum(mn_lo * tl.sum(x_lo, axis=1)[None, :] + mn_hi * tl.sum(x_hi, axis=1)[None, :], axis=1)
        return d * scaled - dmin * mins
    else:  # Q6_K: ql[128], qh[64], int8 scales[16], d
        tl.static_assert(FMT == 14)
        # Sixteen weights a scale: ql byte 16u + v (u < 8) holds, low nibble, weight 128h + 32t + 16(u%2) + v with
        # h = u // 4, t = (u // 2) % 2, and, high nibble, the weight 64 further; qh byte 32h + 16(u%2) + v holds
        # their top two bits at shifts 2t and 2t + 4. Their scales are numbers u + 4h and u + 4h + 4.
        u = tl.arange(0, 8)
        v = tl.arange(0, 16)
        h = u // 4
        t = (u // 2) % 2
        blk = w_ptr + row_off + kb * 210  # [BLOCK_N]
        ql = tl.load(blk[:, None, None] + u[None, :, None] * 16 + v[None, None, :]).to(tl.int32)
        qh = tl.load(blk[:, None, None] + 128 + (h * 32 + (u % 2) * 16)[None, :, None] + v[None, None, :]).to(tl.int32)
        shift = 2 * t[None, :, None]
        lo = ((ql & 15) | (((qh >> shift) & 3) << 4)) - 32
        hi = ((ql >> 4) | (((qh >> (shift + 4)) & 3) << 4)) - 32
        col = k0 + (h * 128 + t * 32 + (u % 2) * 16)[:, None] + v[None, :]  # [8, 16]
        x_lo = tl.load(x_ptr + col).to(tl.float32)
        x_hi = tl.load(x_ptr + col + 64).to(tl.float32)
        s_lo = tl.sum(lo.to(tl.float32) * x_lo[None, :, :], axis=2)  # [BLOCK_N, 8]
        s_hi = tl.sum(hi.to(tl.float32) * x_hi[None, :, :], axis=2)
        sc_lo = tl.load(blk[:, None] + 192 + (u + 4 * h)[None, :]).to(tl.int8, bitcast=True).to(tl.float32)
        sc_hi = tl.load(blk[:, None] + 196 + (u + 4 * h)[None, :]).to(tl.int8, bitcast=True).to(tl.float32)
        return f16_at(blk + 208) * tl.sum(sc_lo * s_lo + sc_hi * s_hi, axis=1)


@triton.jit
def block_weights(w_ptr, row_off, kb, K, tab_ptr, FMT: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_N, 256] fp32 weights of columns kb*256 .. kb*256+255 of the rows at row_off, in column order, read
    block by block as block_dot reads them, each the reference's q * scale + offset (exact products, one rounding):
    the decoded tile a matrix product of many rows of x multiplies."""
    k0 = kb * 256
    if FMT >= 16:
        return codebook_weights(w_ptr, row_off, kb, K, tab_ptr, FMT, BLOCK_N)
    elif FMT == 0:
        k = k0 + tl.arange(0, 256)
        return tl.load(w_ptr + row_off[:, None] + k[None, :], mask=(k < K)[None, :], other=0.0).to(tl.float32)
    elif FMT == 2 or FMT == 3 or FMT == 8:  # 8 blocks of 32 columns
        u = tl.arange(0, 8)
        v = tl.arange(0, 32)
        used = k0 + u * 32 < K
        blk = w_ptr + row_off[:, None] + (kb * 8 + u)[None, :] * (18 if FMT == 2 else (20 if FMT == 3 else 34))
        d = f16_masked(blk, used[None, :])[:, :, None]  # [BLOCK_N, 8, 1]
        if FMT == 8:
            q = tl.load(blk[:, :, None] + 2 + v[None, None, :], mask=used[None, :, None], other=0)
            w = d * q.to(tl.int8, bitcast=True).to(tl.float32)
        else:  # byte v % 16 holds column v (low nibble, v < 16) and v + 16 (high)
            byte = tl.load(blk[:, :, None] + (2 if FMT == 2 else 4) + (v % 16)[None, None, :],
                           mask=used[None, :, None], other=0).to(tl.int32)
            q = (byte >> (4 * (v // 16))[None, None, :]) & 15
            if FMT == 2:
                w = d * (q - 8).to(tl.float32)
            else:
                w = d * q.to(tl.float32) + f16_masked(blk + 2, used[None, :])[:, :, None]
        return tl.reshape(w, (BLOCK_N, 256))
    elif FMT == 12 or FMT == 13:  # sub-block s (32 columns): qs byte 32 (s // 2) + l, nibble s % 2
        s = tl.arange(0, 8)
        v = tl.arange(0, 32)
        blk = w_ptr + row_off + kb * (144 if FMT == 12 else 176)  # [BLOCK_N]
        byte = tl.load(blk[:, None, None] + (16 if FMT == 12 else 48) + (s // 2 * 32)[None, :, None]
                       + v[None, None, :]).to(tl.int32)
        q = (byte >> (4 * (s % 2))[None, :, None]) & 15
        if FMT == 13:
            qh = tl.load(blk[:, None, None] + 16 + v[None, None, :]).to(tl.int32)
            q = q | (((qh >> s[None, :, None]) & 1) << 4)
        d, dmin, a, b, c = k_header(blk)
        sc, mn = k_scale_min_words(a, b, c, s[None, :])  # [BLOCK_N, 8]
        scale = d[:, None] * sc
        offset = dmin[:, None] * mn
        w = scale[:, :, None] * q.to(tl.float32) - offset[:, :, None]
        return tl.reshape(w, (BLOCK_N, 256))
    else:  # Q6_K, sixteen columns a scale: column 16 sub + v
        tl.static_assert(FMT == 14)
        sub = tl.arange(0, 16)
        v = tl.arange(0, 16)
        h = sub // 8
        r = (sub % 8)[None, :, None] * 16 + v[None, None, :]  # column within its half, [1, 16, 16]
        blk = w_ptr + row_off + kb * 210  # [BLOCK_N]
        ql = tl.load(blk[:, None, None] + h[None, :, None] * 64 + r % 64).to(tl.int32)
        qh = tl.load(blk[:, None, None] + 128 + h[None, :, None] * 32 + r % 32).to(tl.int32)
        q = ((ql >> (4 * (r // 64))) & 15) | (((qh >> (2 * (r // 32))) & 3) << 4)
        sc = tl.load(blk[:, None] + 192 + sub[None, :]).to(tl.int8, bitcast=True).to(tl.float32)
        scale = f16_at(blk + 208)[:, None] * sc
        w = scale[:, :, None] * (q - 32).to(tl.float32)
        return tl.reshape(w, (BLOCK_N, 256))


@triton.jit
def _block_gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride, tab_ptr, FMT: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    # Several rows of x (a decode batch, a short chunk): each 256-column tile of weights decoded once per program
    # and multiplied into BLOCK_M rows on the tensor cores.
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_off = tl.minimum(n, N - 1).to(tl.int64) * stride
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(K, 256)):
        k = kb * 256 + tl.arange(0, 256)
        x = tl.load(x_ptr + m.to(tl.int64)[:, None] * K + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :],
                    other=0.0)
        w = block_weights(w_ptr, row_off, kb, K, tab_ptr, FMT, BLOCK_N).to(x.dtype)  # rounded as the reference rounds it
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    tl.store(out_ptr + m.to(tl.int64)[:, None] * N + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(m < M)[:, None] & (n < N)[None, :])


def gemm_tiles(m: int, fmt: int, element_size: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of the block-wise matrix product for m rows of x. Not tuned on a device yet. A codebook's
    fp32 tile of 32 rows by 32 takes up to 128 KiB of shared memory (sm_89 has 99)."""
    if m <= 16:
        return 16, 32
    return (32, 16) if fmt in CODEBOOK_FORMATS and element_size == 4 else (32, 32)


def gemm(x: torch.Tensor, w: torch.Tensor, fmt: int, rows: int, cols: int, row_bytes: int) -> torch.Tensor:
    """x [M, cols] @ W.T -> [M, rows] (for up to GEMM_MAX_ROWS rows of x where the per-weight GEMM reads the
    format too); fmt one of BLOCK_FORMATS."""
    m = x.shape[0]
    check_word_aligned((w, fmt))
    x = x.contiguous()
    out = torch.empty(m, rows, dtype=x.dtype, device=x.device)
    if m:
        bm, bn = gemm_tiles(m, fmt, x.element_size())
        _block_gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(rows, bn))](
            x, w, out, m, rows, cols, cols if fmt == 0 else row_bytes, codebook_tables(x.device), FMT=fmt, BLOCK_M=bm,
            BLOCK_N=bn)
    return out


@triton.jit
def _block_gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride, blocks_per_split, tab_ptr, FMT: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    # Program (i, m, s): BLOCK_N rows of row m of x over the s-th run of blocks_per_split 256-column blocks; out
    # is [splits, M, N] (summed by the caller in a fixed order, so the result is the same every run).
    m = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_off = tl.minimum(n, N - 1).to(tl.int64) * stride
    acc = tl.zeros([BLOCK_N], tl.float32)
    first = split * blocks_per_split
    for kb in range(first, tl.minimum(first + blocks_per_split, tl.cdiv(K, 256))):
        acc += block_dot(w_ptr, row_off, kb, x_ptr + m * K, K, tab_ptr, FMT, BLOCK_N)
    out = out_ptr + (split * tl.num_programs(1) + m) * N + n
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n < N)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 16  # rows a program reads
    warps: int = 4
    splits: int = 1  # programs along the columns: more loads in flight when rows are few


def gemv_config(rows: int) -> GemvConfig:
    """The launch shape for a weight, from bench/device.py's sweep on the H200 (GB/s of blocks read, two runs):
    Mixtral's gate (Q4_K, 14,336 rows) read best with 16 rows a program and 2 warps (700, 537; the old 16 rows
    and 4 warps: 511, 496); its down (Q6_K, 4,096 rows, 56 blocks a row) with 64 rows, 8 warps and the columns
    split in 4 (813, 708; before: 541, 532), since 64 programs of whole rows leave most of the GPU idle."""
    if rows >= 8192:
        return GemvConfig(block_n=16, warps=2)
    return GemvConfig(block_n=64, warps=8, splits=4)


def gemv(x: torch.Tensor, w: torch.Tensor, fmt: int, rows: int, cols: int, row_bytes: int,
         config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, cols] @ W.T -> [M, rows] for a few rows of x; fmt one of BLOCK_FORMATS."""
    m = x.shape[0]
    if not m:
        return torch.empty(0, rows, dtype=x.dtype, device=x.device)
    check_word_aligned((w, fmt))
    cfg = config or gemv_config(rows)
    blocks = triton.cdiv(cols, 256)
    splits = min(cfg.splits, blocks)
    per_split = triton.cdiv(blocks, splits)
    splits = triton.cdiv(blocks, per_split)
    out = torch.empty(splits, m, rows, dtype=x.dtype if splits == 1 else torch.float32, device=x.device)
    grid = (triton.cdiv(rows, cfg.block_n), m, splits)
    args = (x.contiguous(), w, out, rows, cols, cols if fmt == 0 else row_bytes, per_split, codebook_tables(x.device))
    _block_gemv_kernel[grid](*args, FMT=fmt, BLOCK_N=cfg.block_n, num_warps=cfg.warps)
    return out[0] if splits == 1 else out.sum(0).to(x.dtype)
