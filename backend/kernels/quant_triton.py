"""Triton kernels over GGUF blocks: each weight is decoded where the matmul loads it.

The weights stay as the file's bytes ([rows, row_bytes] uint8); `dequant_tile` reads the weights at
any (row, col) positions of one format, and the matmul kernels call it for each tile they load, so
no dequantized copy ever reaches memory. The torch reference (backend/quant/formats.py: dequantize,
then a matmul) is the oracle in tests/backend/test_quant_kernels.py, run with TRITON_INTERPRET=1.
Format codes are GGML type ids (backend/quant/formats.py); 0 is a plain float matrix.
"""

import torch
import triton
import triton.language as tl

from backend.kernels.gguf_bytes_triton import byte_at, f16_at, k_scale_min, nibble
from backend.kernels.quant_codebook_triton import CODEBOOK_FORMATS
from backend.kernels.quant_gemv_triton import BLOCK_FORMATS, GEMM_MAX_ROWS, gemm, gemv


@triton.jit
def dequant_tile(w_ptr, rows, cols, row_bytes, K, FMT: tl.constexpr):
    """fp32 weights at (rows, cols), int tensors that broadcast to the tile's shape, of a [.., K] matrix."""
    if FMT == 0:
        w = tl.load(w_ptr + rows * K + cols).to(tl.float32)
    elif FMT == 8:  # Q8_0: d, 32 x int8
        blk = w_ptr + rows * row_bytes + (cols // 32) * 34
        w = f16_at(blk) * tl.load(blk + 2 + cols % 32).to(tl.int8, bitcast=True).to(tl.float32)
    elif FMT == 2 or FMT == 3:  # Q4_0: d, 16 bytes; Q4_1: d, m, 16 bytes (low nibbles: weights 0-15)
        j = cols % 32
        blk = w_ptr + rows * row_bytes + (cols // 32) * (18 if FMT == 2 else 20)
        q = nibble(byte_at(blk + (2 if FMT == 2 else 4) + j % 16), j >= 16)
        if FMT == 2:
            w = f16_at(blk) * (q - 8).to(tl.float32)
        else:
            w = f16_at(blk) * q.to(tl.float32) + f16_at(blk + 2)
    elif FMT == 6 or FMT == 7:  # Q5_0: d, qh[4], qs[16]; Q5_1: d, m, qh[4], qs[16]
        j = cols % 32
        start = 2 if FMT == 6 else 4
        blk = w_ptr + rows * row_bytes + (cols // 32) * (22 if FMT == 6 else 24)
        high = (byte_at(blk + start + j // 8) >> (j % 8)) & 1
        q = nibble(byte_at(blk + start + 4 + j % 16), j >= 16) | (high << 4)
        if FMT == 6:
            w = f16_at(blk) * (q - 16).to(tl.float32)
        else:
            w = f16_at(blk) * q.to(tl.float32) + f16_at(blk + 2)
    elif FMT == 12 or FMT == 13:  # Q4_K: d, dmin, scales[12], qs[128]; Q5_K: ... qh[32] before qs
        j = cols % 256
        s = j // 32
        blk = w_ptr + rows * row_bytes + (cols // 256) * (144 if FMT == 12 else 176)
        qs = 16 if FMT == 12 else 48
        q = nibble(byte_at(blk + qs + (s // 2) * 32 + j % 32), s % 2 == 1)
        if FMT == 13:
            q = q | (((byte_at(blk + 16 + j % 32) >> s) & 1) << 4)
        sc, mn = k_scale_min(blk + 4, s)
        w = (f16_at(blk) * sc) * q.to(tl.float32) - f16_at(blk + 2) * mn
    elif FMT == 14:  # Q6_K: ql[128], qh[64], int8 scales[16], d
        j = cols % 256
        h = j // 128
        r = j % 128
        blk = w_ptr + rows * row_bytes + (cols // 256) * 210
        low = nibble(byte_at(blk + h * 64 + r % 64), r >= 64)
        high = (byte_at(blk + 128 + h * 32 + r % 32) >> (2 * (r // 32))) & 3
        sc = tl.load(blk + 192 + j // 16).to(tl.int8, bitcast=True).to(tl.float32)
        w = (f16_at(blk + 208) * sc) * ((low | (high << 4)) - 32).to(tl.float32)
    elif FMT == 10:  # Q2_K: scales[16] (4-bit scale, 4-bit min), qs[64], d, dmin
        j = cols % 256
        r = j % 128
        blk = w_ptr + rows * row_bytes + (cols // 256) * 84
        sc = byte_at(blk + j // 16)
        q = (byte_at(blk + 16 + (j // 128) * 32 + r % 32) >> (2 * (r // 32))) & 3
        w = (f16_at(blk + 80) * (sc & 15).to(tl.float32)) * q.to(tl.float32) - f16_at(blk + 82) * (sc >> 4).to(tl.float32)
    else:  # FMT == 11, Q3_K: hmask[32], qs[64], scales[12] (6-bit, packed), d
        tl.static_assert(FMT == 11)
        j = cols % 256
        r = j % 128
        s = j // 16
        blk = w_ptr + rows * row_bytes + (cols // 256) * 110
        low = nibble(byte_at(blk + 96 + s % 8), s >= 8)
        high = (byte_at(blk + 104 + s % 4) >> (2 * (s // 4))) & 3
        sc = ((low | (high << 4)) - 32).to(tl.float32)
        q = (byte_at(blk + 32 + (j // 128) * 32 + r % 32) >> (2 * (r // 32))) & 3
        hbit = (byte_at(blk + j % 32) >> (j // 32)) & 1
        w = (f16_at(blk + 108) * sc) * (q - 4 * (1 - hbit)).to(tl.float32)
    return w


@triton.jit
def _qgemv_kernel(x_ptr, w_ptr, out_ptr, N, K, row_bytes, FMT: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    # Decode-shaped (a few rows of x): one program per (row of x, BLOCK_N outputs), weights streamed once
    # per row of x; the repeats of a small batch hit the cache.
    m = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(n, N - 1).to(tl.int64)[:, None]
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m * K + k, mask=k < K, other=0.0)
        w = dequant_tile(w_ptr, rows, tl.minimum(k, K - 1)[None, :], row_bytes, K, FMT)
        # Rounded to x's dtype first, as the reference's dequantize(dtype) is.
        acc += tl.sum(w.to(x.dtype).to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(out_ptr + m * N + n, acc.to(out_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _qgemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, row_bytes, FMT: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(n, N - 1).to(tl.int64)[None, :]
    mmask = m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m.to(tl.int64)[:, None] * K + k[None, :], mask=mmask[:, None] & (k < K)[None, :],
                    other=0.0)
        w = dequant_tile(w_ptr, rows, tl.minimum(k, K - 1)[:, None], row_bytes, K, FMT)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x, w.to(x.dtype), input_precision="ieee")
    tl.store(out_ptr + m.to(tl.int64)[:, None] * N + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mmask[:, None] & (n < N)[None, :])


GEMV_MAX_ROWS = 4


def linear_tiles(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of the tiled GEMM for m rows of x. Not tuned on a device yet."""
    if m <= 16:
        return 16, 64, 64
    if m <= 64:
        return 32, 64, 64
    return 64, 64, 64


def qlinear(x: torch.Tensor, w: torch.Tensor, fmt: int, rows: int, cols: int, row_bytes: int) -> torch.Tensor:
    """x [M, cols] @ W.T -> [M, rows]; w holds W's blocks ([rows, row_bytes] uint8) or W itself (fmt 0)."""
    m = x.shape[0]
    # the codebooks have block readers only (a grid entry a weight is no read for dequant_tile's scattered loads)
    if fmt in BLOCK_FORMATS and (m <= GEMM_MAX_ROWS or fmt in CODEBOOK_FORMATS):
        return (gemv if m <= GEMV_MAX_ROWS else gemm)(x, w, fmt, rows, cols, row_bytes)
    x = x.contiguous()
    out = torch.empty(m, rows, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if m <= GEMV_MAX_ROWS:
        block_n, block_k = 64, 128
        _qgemv_kernel[(triton.cdiv(rows, block_n), m)](x, w, out, rows, cols, row_bytes, FMT=fmt, BLOCK_N=block_n,
                                                       BLOCK_K=block_k)
    else:
        bm, bn, bk = linear_tiles(m)
        _qgemm_kernel[(triton.cdiv(m, bm), triton.cdiv(rows, bn))](x, w, out, m, rows, cols, row_bytes, FMT=fmt,
                                                                   BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return out
