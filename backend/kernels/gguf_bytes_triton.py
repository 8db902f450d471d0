"""Reading GGUF block fields inside Triton kernels: bytes, fp16 scales, nibbles and the K-quants' packed 6-bit
scales. Shared by the per-weight kernels (quant_triton.py) and the block-wise ones (quant_gemv_triton.py)."""

import triton
import triton.language as tl


@triton.jit
def byte_at(ptr):
    return tl.load(ptr).to(tl.int32)


@triton.jit
def f16_at(ptr):
    lo = tl.load(ptr).to(tl.uint16)
    hi = tl.load(ptr + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def f16_masked(ptr, mask):
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def nibble(byte, high):
    return tl.where(high, byte >> 4, byte & 15)


@triton.jit
def k_scale_min(sc_ptr, s):
    """Q4_K/Q5_K: the 6-bit scale and min of sub-block s (0..7) from the 12 packed bytes at sc_ptr."""
    i = s % 4
    a = byte_at(sc_ptr + i)
    b = byte_at(sc_ptr + 4 + i)
    c = byte_at(sc_ptr + 8 + i)
    first = s < 4
    scale = tl.where(first, a & 63, (c & 15) | ((a >> 6) << 4))
    mn = tl.where(first, b & 63, (c >> 4) | ((b >> 6) << 4))
    return scale.to(tl.float32), mn.to(tl.float32)
