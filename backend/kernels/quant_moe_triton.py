"""The fused MoE of moe_triton.py over experts kept in GGUF blocks.

Same plan as the float kernels (pairs sorted by expert into blocks of BLOCK_M rows, one grouped GEMM
for gate and up with SiLU, one for down with the routing weight), with each expert's weight tile
decoded as it is loaded: block by block (quant_gemv_triton.block_weights) in tiles of 256 columns where the
format has a block reader, else weight by weight (quant_triton.dequant_tile). gate, up and down each have their
own format (Q4_K_M files keep ffn_down in Q6_K; the quantizers' mixes put codebooks beside K-quants), and a stack
may also be plain floats (format 0).
"""

import torch
import triton
import triton.language as tl

from backend.kernels.gguf_bytes_triton import check_word_aligned
from backend.kernels.moe_triton import (
    block_tile,
    load_rows,
    moe_buffers,
    moe_tiles,
    store_rows,
    store_weighted,
)
from backend.kernels.quant_codebook_triton import CODEBOOK_FORMATS, codebook_tables
from backend.kernels.quant_gemv_triton import BLOCK_FORMATS, block_dot, block_weights
from backend.kernels.quant_triton import dequant_tile

MOE_BLOCK_N = 16  # rows of an expert a (token, expert) program reads


@triton.jit
def _swiglu(gate, up, alpha, limit, CLAMP: tl.constexpr):
    """silu(gate) * up, or gpt-oss's clamped form (moe_torch.swiglu_clamped's order of operations)."""
    if CLAMP:
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        act = (u + 1.0) * (g * (1.0 / (1.0 + tl.exp(-(g * alpha)))))
    else:
        act = gate / (1.0 + tl.exp(-gate)) * up
    return act


@triton.jit
def _qmoe_up_kernel(x_ptr, wg_ptr, wu_ptr, pairs_ptr, experts_ptr, used_ptr, inter_ptr, H, INTER, rb_gate, rb_up,
                    tab_ptr, bias_ptr, alpha, limit, HAS_BIAS: tl.constexpr, CLAMP: tl.constexpr, TOP_K: tl.constexpr, FMT_GATE: tl.constexpr, FMT_UP: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCKWISE_GATE: tl.constexpr,
                    BLOCKWISE_UP: tl.constexpr):
    if tl.program_id(0) >= tl.load(used_ptr):
        return
    expert, rows, pairs, valid, n, nmask = block_tile(pairs_ptr, experts_ptr, INTER, BLOCK_M, BLOCK_N)
    tokens = tl.where(valid, pairs // TOP_K, 0)
    n_rows = expert * INTER + tl.minimum(n, INTER - 1).to(tl.int64)
    w_rows = n_rows[None, :]
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, tl.cdiv(H, BLOCK_K)):
        x, k, _ = load_rows(x_ptr, tokens, valid, k0, H, BLOCK_K)
        cols = tl.minimum(k, H - 1)[:, None]
        if BLOCKWISE_GATE:  # BLOCK_K is 256: the rows' next blocks, read block by block
            wg = tl.trans(block_weights(wg_ptr, n_rows * (H if FMT_GATE == 0 else rb_gate), k0, H, tab_ptr,
                                        FMT_GATE, BLOCK_N)).to(x.dtype)
        else:
            wg = dequant_tile(wg_ptr, w_rows, cols, rb_gate, H, FMT_GATE).to(x.dtype)
        if BLOCKWISE_UP:
            wu = tl.trans(block_weights(wu_ptr, n_rows * (H if FMT_UP == 0 else rb_up), k0, H, tab_ptr, FMT_UP,
                                        BLOCK_N)).to(x.dtype)
        else:
            wu = dequant_tile(wu_ptr, w_rows, cols, rb_up, H, FMT_UP).to(x.dtype)
        gate += tl.dot(x, wg, input_precision="ieee")
        up += tl.dot(x, wu, input_precision="ieee")
    if HAS_BIAS:  # gpt-oss's [E, 2I]: gate's columns, then up's
        gate += tl.load(bias_ptr + expert * 2 * INTER + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias_ptr + expert * 2 * INTER + INTER + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    store_rows(inter_ptr, _swiglu(gate, up, alpha, limit, CLAMP), rows, valid, n, nmask, INTER)


@triton.jit
def _qmoe_down_kernel(inter_ptr, w_ptr, pairs_ptr, experts_ptr, used_ptr, weights_ptr, out_ptr, H, INTER, rb_down,
                      tab_ptr, bias_ptr, HAS_BIAS: tl.constexpr, FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCKWISE: tl.constexpr):
    if tl.program_id(0) >= tl.load(used_ptr):
        return
    expert, rows, pairs, valid, n, nmask = block_tile(pairs_ptr, experts_ptr, H, BLOCK_M, BLOCK_N)
    n_rows = expert * H + tl.minimum(n, H - 1).to(tl.int64)
    w_rows = n_rows[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, tl.cdiv(INTER, BLOCK_K)):
        a, k, _ = load_rows(inter_ptr, rows, valid, k0, INTER, BLOCK_K)
        if BLOCKWISE:
            w = tl.trans(block_weights(w_ptr, n_rows * (INTER if FMT == 0 else rb_down), k0, INTER, tab_ptr, FMT,
                                       BLOCK_N)).to(a.dtype)
        else:
            w = dequant_tile(w_ptr, w_rows, tl.minimum(k, INTER - 1)[:, None], rb_down, INTER, FMT).to(a.dtype)
        acc += tl.dot(a, w, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * H + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    store_weighted(out_ptr, acc, weights_ptr, pairs, valid, n, nmask, H)


@triton.jit
def _block_moe_up_kernel(x_ptr, wg_ptr, wu_ptr, ids_ptr, inter_ptr, H, INTER, stride_g, stride_u, tab_ptr, bias_ptr, alpha,
                         limit, HAS_BIAS: tl.constexpr, CLAMP: tl.constexpr, TOP_K: tl.constexpr,
                   FMT_GATE: tl.constexpr, FMT_UP: tl.constexpr, BLOCK_N: tl.constexpr):
    # One program per (token, expert) pair and BLOCK_N rows of that expert's gate and up: SiLU(gate) * up.
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // TOP_K) * H
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = expert * INTER + tl.minimum(n, INTER - 1).to(tl.int64)
    gate = tl.zeros([BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(H, 256)):
        gate += block_dot(wg_ptr, rows * stride_g, kb, x_row, H, tab_ptr, FMT_GATE, BLOCK_N)
        up += block_dot(wu_ptr, rows * stride_u, kb, x_row, H, tab_ptr, FMT_UP, BLOCK_N)
    if HAS_BIAS:
        gate += tl.load(bias_ptr + expert * 2 * INTER + n, mask=n < INTER, other=0.0).to(tl.float32)
        up += tl.load(bias_ptr + expert * 2 * INTER + INTER + n, mask=n < INTER, other=0.0).to(tl.float32)
    act = _swiglu(gate, up, alpha, limit, CLAMP)
    tl.store(inter_ptr + pair * INTER + n, act.to(inter_ptr.dtype.element_ty), mask=n < INTER)


@triton.jit
def _block_moe_down_kernel(inter_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, H, INTER, stride, tab_ptr, bias_ptr,
                           HAS_BIAS: tl.constexpr, FMT: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = expert * H + tl.minimum(n, H - 1).to(tl.int64)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(INTER, 256)):
        acc += block_dot(w_ptr, rows * stride, kb, inter_ptr + pair * INTER, INTER, tab_ptr, FMT, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * H + n, mask=n < H, other=0.0).to(tl.float32)
    acc = acc * tl.load(weights_ptr + pair).to(tl.float32)
    tl.store(out_ptr + pair * H + n, acc.to(out_ptr.dtype.element_ty), mask=n < H)


def _activation(x, biases, clamped_swiglu) -> tuple:
    """The kernels' bias and activation arguments: gate|up's bias, down's, alpha, limit and their two flags (x stands
    in for an absent bias, never read)."""
    b_gate_up, b_down = biases or (None, None)
    if (b_gate_up is None) != (b_down is None):
        raise ValueError("the Triton MoE takes both expert biases (gate|up and down) or neither")
    has_bias = b_gate_up is not None
    alpha, limit = clamped_swiglu or (1.0, 0.0)
    return (b_gate_up.contiguous() if has_bias else x, b_down.contiguous() if has_bias else x, float(alpha),
            float(limit), has_bias, clamped_swiglu is not None)


def moe_gemv(x, gate, up, down, topk_weights, topk_ids, biases=None, clamped_swiglu=None) -> torch.Tensor:
    """fused_moe's contract for a few tokens: every (token, expert) pair reads its expert's rows
    itself (pairs of one expert run side by side and share them through the cache); no sorting by expert."""
    (wg, fmt_g, rb_g), (wu, fmt_u, rb_u), (wd, fmt_d, rb_d) = gate, up, down
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    inter_size = wg.shape[1]
    pairs = tokens * top_k
    check_word_aligned((wg, fmt_g), (wu, fmt_u), (wd, fmt_d))
    if tokens == 0:
        return torch.zeros_like(x)
    ids = topk_ids.flatten().contiguous()
    inter = torch.empty(pairs, inter_size, dtype=x.dtype, device=x.device)
    out_pairs = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    tables = codebook_tables(x.device)
    b_gu, b_d, alpha, limit, has_bias, clamp = _activation(x, biases, clamped_swiglu)
    _block_moe_up_kernel[(pairs, triton.cdiv(inter_size, MOE_BLOCK_N))](
        x.contiguous(), wg, wu, ids, inter, hidden, inter_size, hidden if fmt_g == 0 else rb_g,
        hidden if fmt_u == 0 else rb_u, tables, b_gu, alpha, limit, HAS_BIAS=has_bias, CLAMP=clamp, TOP_K=top_k,
        FMT_GATE=fmt_g, FMT_UP=fmt_u, BLOCK_N=MOE_BLOCK_N)
    _block_moe_down_kernel[(pairs, triton.cdiv(hidden, MOE_BLOCK_N))](
        inter, wd, ids, topk_weights.flatten().contiguous(), out_pairs, hidden, inter_size,
        inter_size if fmt_d == 0 else rb_d, tables, b_d, HAS_BIAS=has_bias, FMT=fmt_d, BLOCK_N=MOE_BLOCK_N)
    return out_pairs.view(tokens, top_k, hidden).sum(1)


# Up to this many tokens every (token, expert) pair reads its expert's rows itself (moe_gemv);
# past it the grouped GEMM's block tiles share them. On the H200 (Mixtral's layer, Q4_K_M) per pair took 0.365,
# 1.18 and 2.27 ms at 1, 4 and 8 tokens, the grouped block tiles 0.548, 0.832 and 1.13.
GEMV_TOKENS = 1


def fused_moe(x, gate, up, down, topk_weights, topk_ids, tiles: tuple[int, int, int] | None = None, biases=None,
              clamped_swiglu: tuple[float, float] | None = None):
    """x [T, H] -> [T, H]. gate, up, down: (tensor, format, row_bytes), tensors [E, I, ..] / [E, H, ..].
    tiles: the grouped GEMM's, which then runs whatever the token count (its BLOCK_K 256 where a stack is a codebook,
    whose only reader is block-wise). gpt-oss's experts: biases (gate|up [E, 2I], down [E, H]) and
    clamped_swiglu's (alpha, limit), as moe_torch.fused_moe takes them."""
    (wg, fmt_g, rb_g), (wu, fmt_u, rb_u), (wd, fmt_d, rb_d) = gate, up, down
    tokens, hidden = x.shape
    formats = (fmt_g, fmt_u, fmt_d)
    block_formats = set(formats) <= set(BLOCK_FORMATS)
    codebooks = bool(set(formats) & set(CODEBOOK_FORMATS))
    if tiles is None and tokens <= GEMV_TOKENS and block_formats:
        return moe_gemv(x, gate, up, down, topk_weights, topk_ids, biases, clamped_swiglu)
    top_k = topk_ids.shape[1]
    num_experts, inter_size = wg.shape[0], wg.shape[1]
    if tokens == 0:
        return torch.zeros_like(x)
    # Formats read block by block: tiles of 256 columns (16 rows, so that x, gate's and up's tiles fit sm_89's
    # shared memory in fp32); the others decode each weight of the per-weight tiles.
    block_m, block_n, block_k = tiles or ((16, 32, 256) if block_formats or codebooks
                                          else moe_tiles(tokens * top_k, num_experts))
    if codebooks and (block_k != 256 or x.element_size() == 4):
        # read block-wise only, in the block tiles (larger ones overflow shared memory; in fp32 two codebook tiles of
        # 32 rows take 112 KiB, sm_89 has 99)
        block_m, block_n, block_k = 16, 16 if x.element_size() == 4 else 32, 256
    bw_g, bw_u, bw_d = (block_k == 256 and fmt in BLOCK_FORMATS for fmt in formats)
    check_word_aligned(*[(w, fmt) for w, fmt, blockwise in zip((wg, wu, wd), formats, (bw_g, bw_u, bw_d)) if blockwise])
    tables = codebook_tables(x.device)
    sorted_pairs, block_expert, used, inter, out_pairs = moe_buffers(x, topk_ids, num_experts, inter_size, block_m)
    blocks = block_expert.numel()
    x = x.contiguous()
    b_gu, b_d, alpha, limit, has_bias, clamp = _activation(x, biases, clamped_swiglu)
    _qmoe_up_kernel[(blocks, triton.cdiv(inter_size, block_n))](
        x, wg, wu, sorted_pairs, block_expert, used, inter, hidden, inter_size, rb_g, rb_u, tables, b_gu, alpha, limit,
        HAS_BIAS=has_bias, CLAMP=clamp, TOP_K=top_k,
        FMT_GATE=fmt_g, FMT_UP=fmt_u, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCKWISE_GATE=bw_g,
        BLOCKWISE_UP=bw_u)
    _qmoe_down_kernel[(blocks, triton.cdiv(hidden, block_n))](
        inter, wd, sorted_pairs, block_expert, used, topk_weights.flatten().contiguous(), out_pairs, hidden,
        inter_size, rb_d, tables, b_d, HAS_BIAS=has_bias, FMT=fmt_d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCKWISE=bw_d)
    return out_pairs.view(tokens, top_k, hidden).sum(1)
