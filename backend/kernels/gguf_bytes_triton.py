"""Reading GGUF block fields inside Triton kernels: bytes, fp16 scales, nibbles and the K-quants' packed 6-bit
scales. Shared by the per-weight kernels (quant_triton.py) and the block-wise ones (quant_gemv_triton.py)."""

import torch
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


@triton.jit
def k_header(blk):
    """Q4_K/Q5_K: the first 16 bytes of the blocks at blk ([N] byte pointers, each 16-byte aligned: the blocks are
    144 and 176 bytes) in one vector load a row instead of ten byte loads: (d, dmin) as fp32 and the 12 packed
    scale bytes as three little-endian words, each [N, 1], for k_scale_min_words."""
    words = tl.load(blk.to(tl.pointer_type(tl.int32))[:, None] + tl.arange(0, 4)[None, :])  # [N, 4]
    col = tl.arange(0, 4)[None, :]
    w0 = tl.sum(tl.where(col == 0, words, 0), axis=1)
    d = (w0 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = ((w0 >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    a = tl.sum(tl.where(col == 1, words, 0), axis=1)[:, None]
    b = tl.sum(tl.where(col == 2, words, 0), axis=1)[:, None]
    c = tl.sum(tl.where(col == 3, words, 0), axis=1)[:, None]
    return d, dmin, a, b, c


@triton.jit
def k_scale_min_words(a, b, c, s):
    """k_scale_min from k_header's words: a, b, c [N, 1] (scale bytes 0-3, 4-7, 8-11), s [1, S] -> [N, S] each."""
    shift = 8 * (s % 4)
    a = (a >> shift) & 255
    b = (b >> shift) & 255
    c = (c >> shift) & 255
    first = s < 4
    scale = tl.where(first, a & 63, (c & 15) | ((a >> 6) << 4))
    mn = tl.where(first, b & 63, (c >> 4) | ((b >> 6) << 4))
    return scale.to(tl.float32), mn.to(tl.float32)


def check_word_aligned(*weights: tuple[torch.Tensor, int]) -> None:
    """k_header reads Q4_K/Q5_K blocks' first 16 bytes as int32 words: a misaligned load would end the CUDA context
    (every request with it), so an engine that ever hands over an unaligned view fails here instead. Weights made
    by the loader are fresh allocations of whole blocks, always aligned."""
    for w, fmt in weights:
        if fmt in (12, 13) and w.data_ptr() % 4:
            raise ValueError(f"a Q4_K/Q5_K weight starts at an address that is not a multiple of 4 "
                             f"({w.data_ptr():#x}); copy it into a tensor of its own (.clone())")
