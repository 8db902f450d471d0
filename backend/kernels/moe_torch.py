"""Mixture-of-experts feed-forward, computed grouped by expert (torch reference)."""

import torch
import torch.nn.functional as F
from torch import nn

from backend.kernels import native, use_triton


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, keep the top k, optionally renormalise them to sum to one."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def c_reads(linear: nn.Module, rows: int | None = None) -> bool:
    """Whether cpu_moe.c (and the one-call step) can read this router or shared-expert gate as it is: a plain
    nn.Linear without bias, its weight fp32, contiguous, on the CPU (and of `rows` rows)."""
    w = linear.weight
    return type(linear) is nn.Linear and linear.bias is None and native.usable(w) and w.is_contiguous() \
        and (rows is None or w.shape[0] == rows)


def route_rows(x: torch.Tensor, gate: nn.Module, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """route() of the router's logits for x [T, H]; with our CPU kernels, in one C call (cpu_moe.c's
    moe_route_rows: the one-call decode step's router, so both give the same bits, each row's whatever the rows
    beside it)."""
    w = gate.weight
    if c_reads(gate) and native.usable(x) and x.is_contiguous() and 0 < top_k <= w.shape[0]:
        ids = torch.empty(x.shape[0], top_k, dtype=torch.int64)
        weights = torch.empty(x.shape[0], top_k)
        if not native.library().moe_route_rows(x.data_ptr(), x.shape[0], w.data_ptr(), w.shape[0], w.shape[1],
                                               top_k, int(renormalize), ids.data_ptr(), weights.data_ptr(),
                                               torch.get_num_threads()):
            raise MemoryError(f"no memory for the router logits of {x.shape[0]} tokens")
        return weights, ids
    return route(gate(x), top_k, renormalize)


def add_shared(out: torch.Tensor, x: torch.Tensor, gate: nn.Module, shared: torch.Tensor) -> torch.Tensor:
    """out + sigmoid(gate(x)) * shared: Qwen2-MoE's gated shared expert added to the routed experts' sum; with our
    CPU kernels in one C call (cpu_moe.c's moe_add_shared_rows, in place: the one-call decode step's)."""
    if c_reads(gate, 1) and native.usable(out, x, shared) and all(t.is_contiguous() for t in (out, x, shared)):
        native.library().moe_add_shared_rows(x.data_ptr(), x.shape[0], gate.weight.data_ptr(), x.shape[1],
                                             shared.data_ptr(), out.data_ptr())
        return out
    return out + torch.sigmoid(gate(x)) * shared


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H]; w_gate_up [E, 2I, H]; w_down [E, H, I]; topk_* [T, K] -> [T, H].

    Every (token, expert) pair is sorted by expert so each active expert runs one GEMM over
    all its tokens; results are weighted and scatter-added back to their tokens. On CUDA the same
    contract runs as two grouped-GEMM Triton kernels (backend/kernels/moe_triton.py).
    """
    if use_triton(x):
        from backend.kernels import moe_triton

        return moe_triton.fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids)
    weights = topk_weights.flatten()
    out = torch.zeros_like(x)
    for expert, pairs, tokens in expert_groups(topk_ids, w_gate_up.shape[0]):
        gate, up = F.linear(x[tokens], w_gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down[expert])
        y = y * weights[pairs, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def expert_groups(topk_ids: torch.Tensor, num_experts: int):
    """(expert, pairs, tokens) for each expert some token routes to: pairs index the flattened [T * top_k] choices
    (to their weights), tokens the rows of x, both in token order."""
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)
    start = 0
    for expert, count in enumerate(torch.bincount(flat_ids, minlength=num_experts).tolist()):
        if count:
            pairs = order[start:start + count]
            yield expert, pairs, pairs // top_k
        start += count
