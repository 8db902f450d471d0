"""The fused mixture of experts for CUDA: (token, expert) pairs sorted by expert into blocks of BLOCK_M rows
(align_by_expert), one grouped GEMM for gate and up with SiLU, one for down with the routing weight; the counterpart
of backend/kernels/moe_torch.py's torch reference, tested against it under TRITON_INTERPRET=1
(tests/backend/test_triton_kernels.py). quant_moe_triton.py runs the same plan over GGUF blocks."""

import torch
import triton
import triton.language as tl


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """(token, k) pairs sorted by expert, each expert's run padded to whole blocks of block_m rows.

    Every shape depends on the input's shape only, never on the routing, so nothing waits for the
    device and a CUDA graph can hold the whole MoE layer: the padded length is bounded by
    pairs + experts * (block_m - 1). Returns sorted_pairs [bound] (pair ids, -1 for padding),
    block_expert [bound // block_m] and used_blocks [1]; the kernels skip blocks past used_blocks.
    """
    flat = topk_ids.flatten()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    blocks_of = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks_of, 0)  # each expert's blocks end here (exclusive)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(flat.numel(), device=dev) - (torch.cumsum(counts, 0) - counts)[expert_of]
    bound = triton.cdiv(flat.numel() + num_experts * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((bound,), -1, dtype=torch.long, device=dev)
    sorted_pairs[(block_end - blocks_of)[expert_of] * block_m + rank] = order
    blocks = torch.arange(bound // block_m, device=dev)
    block_expert = torch.searchsorted(block_end, blocks, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, block_expert, block_end[-1:]


@triton.jit
def block_tile(pairs_ptr, experts_ptr, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A program's tile: block program_id(0)'s expert and its BLOCK_M rows (their pair ids and which hold a pair;
    the rest is padding), and the BLOCK_N output columns n of program_id(1) (nmask: those below N)."""
    mb = tl.program_id(0)
    expert = tl.load(experts_ptr + mb).to(tl.int64)
    rows = (mb * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # rows * INTER passes 2**31 in large batches
    pairs = tl.load(pairs_ptr + rows)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, rows, pairs, pairs >= 0, n, n < N


@triton.jit
def load_rows(ptr, at, valid, k0, K, BLOCK_K: tl.constexpr):
    """Columns k0 * BLOCK_K.. of the valid rows at `at` of a [*, K] matrix (zeros elsewhere), and the columns."""
    k = k0 * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = k < K
    return tl.load(ptr + at[:, None] * K + k[None, :], mask=valid[:, None] & kmask[None, :], other=0.0), k, kmask


@triton.jit
def store_rows(ptr, tile, at, valid, n, nmask, N):
    """The tile into columns n of the valid rows at `at` of a [*, N] matrix, in its dtype."""
    tl.store(ptr + at[:, None] * N + n[None, :], tile.to(ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


@triton.jit
def store_weighted(out_ptr, acc, weights_ptr, pairs, valid, n, nmask, H):
    """Each valid row of acc times its pair's routing weight, into the pair's row of out [pairs, H]."""
    at = tl.where(valid, pairs, 0)
    weight = tl.load(weights_ptr + at, mask=valid, other=0.0).to(tl.float32)
    store_rows(out_ptr, acc * weight[:, None], at, valid, n, nmask, H)


def moe_buffers(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, inter_size: int, block_m: int):
    """align_by_expert's plan and the two kernels' outputs: (sorted_pairs, block_expert, used, inter, out_pairs)."""
    sorted_pairs, block_expert, used = align_by_expert(topk_ids, num_experts, block_m)
    inter = torch.empty(sorted_pairs.numel(), inter_size, dtype=x.dtype, device=x.device)
    out_pairs = torch.empty(topk_ids.numel(), x.shape[1], dtype=x.dtype, device=x.device)
    return sorted_pairs, block_expert, used, inter, out_pairs


@triton.jit
def _moe_up_kernel(x_ptr, w_ptr, pairs_ptr, experts_ptr, used_ptr, inter_ptr, H, INTER, TOP_K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    if tl.program_id(0) >= tl.load(used_ptr):
        return
    expert, rows, pairs, valid, n, nmask = block_tile(pairs_ptr, experts_ptr, INTER, BLOCK_M, BLOCK_N)
    tokens = tl.where(valid, pairs // TOP_K, 0)
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_base = w_ptr + expert * (2 * INTER * H)
    for k0 in range(0, tl.cdiv(H, BLOCK_K)):
        x, k, kmask = load_rows(x_ptr, tokens, valid, k0, H, BLOCK_K)
        wg = tl.load(w_base + n[None, :] * H + k[:, None], mask=nmask[None, :] & kmask[:, None], other=0.0)
        wu = tl.load(w_base + (INTER + n[None, :]) * H + k[:, None], mask=nmask[None, :] & kmask[:, None], other=0.0)
        gate += tl.dot(x, wg, input_precision="ieee")
        up += tl.dot(x, wu, input_precision="ieee")
    act = gate / (1.0 + tl.exp(-gate)) * up  # SiLU(gate) * up
    store_rows(inter_ptr, act, rows, valid, n, nmask, INTER)


@triton.jit
def _moe_down_kernel(inter_ptr, w_ptr, pairs_ptr, experts_ptr, used_ptr, weights_ptr, out_ptr, H, INTER,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    if tl.program_id(0) >= tl.load(used_ptr):
        return
    expert, rows, pairs, valid, n, nmask = block_tile(pairs_ptr, experts_ptr, H, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, tl.cdiv(INTER, BLOCK_K)):
        a, k, kmask = load_rows(inter_ptr, rows, valid, k0, INTER, BLOCK_K)
        w = tl.load(w_ptr + expert * (H * INTER) + n[None, :] * INTER + k[:, None], mask=nmask[None, :] & kmask[:, None],
                    other=0.0)
        acc += tl.dot(a, w, input_precision="ieee")
    store_weighted(out_ptr, acc, weights_ptr, pairs, valid, n, nmask, H)


def moe_tiles(pairs: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): decode-sized batches (a few rows per expert) read weights in narrow
    tiles so that many programs stream them at once; larger ones use square tiles for reuse.
    Not tuned on a device yet."""
    if pairs <= 16 * num_experts:
        return 16, 32, 128
    return 64, 64, 64


def fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, tiles: tuple[int, int, int] | None = None):
    """Same contract as backend.kernels.moe_torch.fused_moe: x [T, H] -> [T, H]. Never waits for the device."""
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, two_i, _ = w_gate_up.shape
    inter_size = two_i // 2
    if tokens == 0:
        return torch.zeros_like(x)
    block_m, block_n, block_k = tiles or moe_tiles(tokens * top_k, num_experts)
    sorted_pairs, block_expert, used, inter, out_pairs = moe_buffers(x, topk_ids, num_experts, inter_size, block_m)
    blocks = block_expert.numel()
    x = x.contiguous()
    _moe_up_kernel[(blocks, triton.cdiv(inter_size, block_n))](
        x, w_gate_up.contiguous(), sorted_pairs, block_expert, used, inter, hidden, inter_size, TOP_K=top_k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    _moe_down_kernel[(blocks, triton.cdiv(hidden, block_n))](
        inter, w_down.contiguous(), sorted_pairs, block_expert, used, topk_weights.flatten().contiguous(), out_pairs,
        hidden, inter_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out_pairs.view(tokens, top_k, hidden).sum(1)
