"""The latent attention's decode rows on CUDA (Triton): each row's heads attend in the latent space to the paged
latent cache (kernels/mla_attention.py says what the rows hold), reading every cached row once for a tile of
heads. W_UK and W_UV stay outside, as matrix products of the whole batch."""

import torch
import triton
import triton.language as tl

KV_TILE = 32  # cached positions a step
HEAD_TILE = 16  # query heads a program (the tensor cores' minimum rows)


@triton.jit
def _latent_decode_kernel(
    q_ptr,
    cache_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    scale,
    table_stride,
    H: tl.constexpr,
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TILE: tl.constexpr,
):
    # One program per (row, tile of BLOCK_H heads); q's rows are [latent L | rotary R], as the cache's are.
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    lat = tl.arange(0, BLOCK_L)
    rot = tl.arange(0, BLOCK_R)
    lmask, rmask = lat < L, rot < R
    q_row = q_ptr + (b * H + heads)[:, None] * (L + R)
    q_lat = tl.load(q_row + lat[None, :], mask=hmask[:, None] & lmask[None, :], other=0.0)
    q_rot = tl.load(q_row + L + rot[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
    ctx = tl.load(lens_ptr + b)
    m = tl.full([BLOCK_H], -float("inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    offs = tl.arange(0, TILE)
    for n in range(0, tl.cdiv(ctx, TILE)):
        pos = n * TILE + offs
        valid = pos < ctx
        block = tl.load(tables_ptr + b * table_stride + pos // BS, mask=valid, other=0)
        row = cache_ptr + ((block * BS + pos % BS) * (L + R))[:, None]
        c_lat = tl.load(row + lat[None, :], mask=valid[:, None] & lmask[None, :], other=0.0).to(q_lat.dtype)
        c_rot = tl.load(row + L + rot[None, :], mask=valid[:, None] & rmask[None, :], other=0.0).to(
            q_rot.dtype
        )
        s = tl.dot(q_lat, tl.trans(c_lat), input_precision="ieee").to(tl.float32)
        s += tl.dot(q_rot, tl.trans(c_rot), input_precision="ieee").to(tl.float32)
        s = tl.where(valid[None, :], s * scale, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.where(valid[None, :], tl.exp(s - m_new[:, None]), 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(c_lat.dtype), c_lat, input_precision="ieee").to(tl.float32)
        denom = denom * alpha + tl.sum(p, axis=1)
        m = m_new
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]  # a padding row (length 0) writes zeros
    tl.store(
        out_ptr + (b * H + heads)[:, None] * L + lat[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=hmask[:, None] & lmask[None, :],
    )


def latent_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    kv_lora: int,
) -> torch.Tensor:
    """q [N, H, kv_lora + rope] (W_UK already applied to its non-rotary part); k_cache [blocks, block_size, 1,
    kv_lora + rope] -> the attended latents [N, H, kv_lora]."""
    n, heads, width = q.shape
    out = q.new_empty(n, heads, kv_lora)
    if n == 0:
        return out
    grid = (n, triton.cdiv(heads, HEAD_TILE))
    _latent_decode_kernel[grid](
        q.contiguous(),
        k_cache,
        tables,
        lens,
        out,
        scale,
        tables.stride(0),
        H=heads,
        L=kv_lora,
        R=width - kv_lora,
        BLOCK_L=max(triton.next_power_of_2(kv_lora), 16),
        BLOCK_R=max(triton.next_power_of_2(width - kv_lora), 16),
        BS=k_cache.shape[1],
        BLOCK_H=HEAD_TILE,
        TILE=KV_TILE,
    )
    return out
