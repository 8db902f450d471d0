"""Triton kernels for CUDA (KV-cache writes, paged attention, RMSNorm, rotary), each the counterpart of a torch
reference in this package; the fused MoE is in moe_triton.py, the kernels over GGUF blocks in quant_*triton.py.

They are tested on the CPU with TRITON_INTERPRET=1 against those references (tests/backend/
test_triton_kernels.py). Only the *triton.py modules import triton, and only the CUDA path imports them.
"""

import torch
import triton
import triton.language as tl


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


# KV-cache write through a slot mapping ----------------------------------------------------------------

@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, row: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:  # a negative slot is a padding row (CUDA graphs pad decode batches)
        offs = tl.arange(0, BLOCK)
        mask = offs < row
        tl.store(k_cache_ptr + slot * row + offs, tl.load(k_ptr + t * row + offs, mask=mask), mask=mask)
        tl.store(v_cache_ptr + slot * row + offs, tl.load(v_ptr + t * row + offs, mask=mask), mask=mask)


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    tokens = key.shape[0]
    row = key.shape[1] * key.shape[2]
    _store_kv_kernel[(tokens,)](key.contiguous(), value.contiguous(), k_cache, v_cache, slot_mapping, row,
                                BLOCK=_pow2(row))


# Paged decode attention (GQA, block tables, variable lengths) -----------------------------------------

# Keys and values are read in tiles of KV_TILE tokens whatever the cache's block size (every token's block is
# looked up on its own), so shared memory does not grow with block_size: 256-token blocks fit an RTX 4090 too.
KV_TILE = 64

@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, lens_ptr, out_ptr, sinks_ptr, scale, window,
                   table_stride, HAS_SINKS: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                   BLOCK_D: tl.constexpr, BS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                   TILE: tl.constexpr):
    # One program per (sequence, kv head): the GROUP query heads that share a kv head read its keys and
    # values once, as the rows of a matrix product (padded to BLOCK_G >= 16 rows, the tensor-core minimum).
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    gmask = g < GROUP
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(q_ptr + (b * HQ + heads)[:, None] * D + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)
    ctx = tl.load(lens_ptr + b)
    m = tl.full([BLOCK_G], -float("inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    offs = tl.arange(0, TILE)  # TILE tokens per step, each looked up in its own cache block
    first = tl.maximum(ctx - window, 0) // TILE  # tiles wholly before the sliding window are skipped
    for n in range(first, tl.cdiv(ctx, TILE)):
        pos = n * TILE + offs
        valid = (pos < ctx) & (pos >= ctx - window)
        block = tl.load(tables_ptr + b * table_stride + pos // BS, mask=pos < ctx, other=0)
        base = ((block * BS + pos % BS) * HKV + kv_head) * D
        kv_mask = valid[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee").to(tl.float32) * scale  # [BLOCK_G, TILE]
        s = tl.where(valid[None, :], s, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # nothing seen yet: keep exp() finite
        alpha = tl.exp(m - m_safe)
        p = tl.where(valid[None, :], tl.exp(s - m_safe[:, None]), 0.0)
        v = tl.load(v_cache_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee").to(tl.float32)
        denom = denom * alpha + tl.sum(p, axis=1)
        m = m_new
    if HAS_SINKS:
        acc, denom = _with_sink(acc, denom, m, tl.load(sinks_ptr + heads, mask=gmask, other=0.0).to(tl.float32))
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]  # a padding row (length 0) writes zeros
    tl.store(out_ptr + (b * HQ + heads)[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=gmask[:, None] & dmask[None, :])


@triton.jit
def _with_sink(acc, denom, m, sink):
    # The sink (one logit a head, gpt-oss's) as one more softmax term that weighs no value: the running sums
    # rescaled to the larger of their top score and the sink, the sink's own term added to the denominator.
    top = tl.maximum(m, sink)
    alpha = tl.exp(m - top)
    return acc * alpha[:, None], denom * alpha + tl.exp(sink - top)


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=None, sinks=None):
    b, hq, d = q.shape
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty_like(q)
    window = sliding_window if sliding_window is not None else 1 << 30
    group = hq // hkv
    _decode_kernel[(b, hkv)](q.contiguous(), k_cache, v_cache, block_tables, context_lens, out,
                             sinks if sinks is not None else q, scale, window, block_tables.stride(0),
                             HAS_SINKS=sinks is not None, HQ=hq, HKV=hkv, D=d, BLOCK_D=max(_pow2(d), 16), BS=bs,
                             GROUP=group, BLOCK_G=max(_pow2(group), 16), TILE=KV_TILE)
    return out


# Prefill attention over a paged cache with a prefix-cached context ------------------------------------

@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, cu_q_ptr, lens_ptr, out_ptr, sinks_ptr, scale,
                    window, table_stride, HAS_SINKS: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr,
                    TILE: tl.constexpr):
    # One program per (sequence, query head, tile of BLOCK_M queries); keys in tiles of TILE tokens,
    # each token's cache block looked up in the table (a tile spans several blocks).
    seq = tl.program_id(0)
    h = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M < q_len:
        kv_head = h // (HQ // HKV)
        ctx = tl.load(lens_ptr + seq)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        q_pos = ctx - q_len + rows
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        q = tl.load(q_ptr + ((q_start + rows[:, None]) * HQ + h) * D + d[None, :],
                    mask=row_ok[:, None] & dmask[None, :], other=0.0)
        m = tl.full([BLOCK_M], -float("inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        offs = tl.arange(0, TILE)
        # Causal: no query of this tile sees past its last row; the window: nor before its first row's reach.
        last = tl.minimum(ctx, ctx - q_len + (tile + 1) * BLOCK_M)
        first = tl.maximum(ctx - q_len + tile * BLOCK_M - window + 1, 0) // TILE
        for n in range(first, tl.cdiv(last, TILE)):
            k_pos = n * TILE + offs
            in_ctx = k_pos < ctx
            block = tl.load(tables_ptr + seq * table_stride + k_pos // BS, mask=in_ctx, other=0)
            base = ((block * BS + k_pos % BS) * HKV + kv_head) * D
            kmask = in_ctx[:, None] & dmask[None, :]
            k = tl.load(k_cache_ptr + base[:, None] + d[None, :], mask=kmask, other=0.0)
            v = tl.load(v_cache_ptr + base[:, None] + d[None, :], mask=kmask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision="ieee").to(tl.float32) * scale
            allowed = (k_pos[None, :] <= q_pos[:, None]) & in_ctx[None, :] & \
                (k_pos[None, :] > q_pos[:, None] - window) & row_ok[:, None]
            s = tl.where(allowed, s, -float("inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            p = tl.where(allowed, tl.exp(s - m_safe[:, None]), 0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee").to(tl.float32)
            denom = denom * alpha + tl.sum(p, axis=1)
            m = m_new
        if HAS_SINKS:
            sink = tl.zeros([BLOCK_M], tl.float32) + tl.load(sinks_ptr + h).to(tl.float32)
            acc, denom = _with_sink(acc, denom, m, sink)
        out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        tl.store(out_ptr + ((q_start + rows[:, None]) * HQ + h) * D + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dmask[None, :])


def prefill_attention(q, k_cache, v_cache, block_tables, cu_q, context_lens, max_q_len, scale,
                      sliding_window=None, sinks=None, block_m: int = 64):
    """q [T, Hq, D]: every chunk's queries back to back (cu_q [N+1] offsets), each the last tokens of a
    context of context_lens[i] tokens already in the cache (block_tables [N, max_blocks])."""
    t, hq, d = q.shape
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty_like(q)
    window = sliding_window if sliding_window is not None else 1 << 30
    block_m = min(block_m, max(_pow2(max_q_len), 16))  # short chunks (speculative verification) in short tiles
    grid = (context_lens.shape[0], hq, triton.cdiv(max_q_len, block_m))
    _prefill_kernel[grid](q.contiguous(), k_cache, v_cache, block_tables, cu_q, context_lens, out,
                          sinks if sinks is not None else q, scale, window, block_tables.stride(0),
                          HAS_SINKS=sinks is not None, HQ=hq, HKV=hkv, D=d, BLOCK_D=max(_pow2(d), 16), BS=bs,
                          BLOCK_M=block_m, TILE=KV_TILE)
    return out


# RMSNorm, optionally fused with the residual add -----------------------------------------------------

@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n, eps, HAS_RES: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * n + offs, mask=mask, other=0.0)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * n + offs, mask=mask, other=0.0)
        tl.store(res_out_ptr + row * n + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
    y = (xf * rstd).to(x.dtype) * tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * n + offs, y, mask=mask)


def rms_norm(x, weight, eps, residual=None):
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    out = torch.empty_like(x2)
    summed = torch.empty_like(x2) if residual is not None else out
    res = residual.reshape(-1, shape[-1]).contiguous() if residual is not None else x2
    _rms_norm_kernel[(x2.shape[0],)](x2, res, weight, out, summed, shape[-1], eps, HAS_RES=residual is not None,
                                     BLOCK=_pow2(shape[-1]))
    if residual is None:
        return out.view(shape)
    return out.view(shape), summed.view(shape)


# Rotary embedding ("rotate half" layout) ---------------------------------------------------------------

@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                   BLOCK: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    base = (t * H + h) * D
    x1 = tl.load(x_ptr + base + i, mask=mask, other=0.0)
    x2 = tl.load(x_ptr + base + HALF + i, mask=mask, other=0.0)
    cos = tl.load(cos_ptr + t * D + i, mask=mask, other=0.0)  # cos/sin repeat their first half
    sin = tl.load(sin_ptr + t * D + i, mask=mask, other=0.0)
    tl.store(out_ptr + base + i, x1 * cos - x2 * sin, mask=mask)
    tl.store(out_ptr + base + HALF + i, x2 * cos + x1 * sin, mask=mask)


def apply_rotary(x, cos, sin):
    t, h, d = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    _rotary_kernel[(t, h)](x, cos.contiguous(), sin.contiguous(), out, H=h, D=d, HALF=d // 2, BLOCK=_pow2(d // 2))
    return out
