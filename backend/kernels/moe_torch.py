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


def route_groups(router_logits: torch.Tensor, top_k: int, renormalize: bool, router: str, n_group: int,
                 topk_group: int, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routers, experts chosen within the topk_group best of n_group equal groups. group_limited
    (V2's group_limited_greedy): softmax scores, a group as good as its best expert. sigmoid_bias (V3's and
    GLM-4.5's noaux_tc): sigmoid scores; the choice by score + bias, a group as good as its two best; the weights
    the unbiased scores. Renormalised where the model says."""
    logits = router_logits.float()
    if router == "group_limited":
        scores = torch.softmax(logits, dim=-1)
        choice = scores
        group_scores = choice.unflatten(-1, (n_group, -1)).amax(dim=-1)
    else:
        scores = torch.sigmoid(logits)
        choice = scores + bias.float()
        group_scores = choice.unflatten(-1, (n_group, -1)).topk(2, dim=-1).values.sum(dim=-1)
    if topk_group < n_group:
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~kept.repeat_interleave(choice.shape[-1] // n_group, dim=-1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights, ids


def c_reads(linear: nn.Module, rows: int | None = None, bias: bool = False) -> bool:
    """Whether cpu_moe.c (and the one-call step) can read this router or shared-expert gate as it is: a plain
    nn.Linear, its weight fp32, contiguous, on the CPU (and of `rows` rows), without a bias (or with an fp32 one
    where the caller passes it on: a router's, gpt-oss's)."""
    w, b = linear.weight, linear.bias
    return type(linear) is nn.Linear and native.usable(w) and w.is_contiguous() \
        and (b is None or (bias and native.usable(b) and b.is_contiguous())) and (rows is None or w.shape[0] == rows)


def route_rows(x: torch.Tensor, gate: nn.Module, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """route() of the router's logits for x [T, H]; with our CPU kernels, in one C call (cpu_moe.c's
    moe_route_rows: the one-call decode step's router, so both give the same bits, each row's whatever the rows
    beside it)."""
    w, b = gate.weight, gate.bias
    if c_reads(gate, bias=True) and native.usable(x) and x.is_contiguous() and 0 < top_k <= w.shape[0]:
        ids = torch.empty(x.shape[0], top_k, dtype=torch.int64)
        weights = torch.empty(x.shape[0], top_k)
        if not native.library().moe_route_rows(x.data_ptr(), x.shape[0], w.data_ptr(),
                                               b.data_ptr() if b is not None else None, w.shape[0], w.shape[1],
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
              topk_ids: torch.Tensor, b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None,
              clamped_swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """x [T, H]; w_gate_up [E, 2I, H]; w_down [E, H, I]; topk_* [T, K] -> [T, H]. gpt-oss's experts: biases
    b_gate_up [E, 2I] and b_down [E, H], and clamped_swiglu's (alpha, limit) in place of silu(gate) * up.

    Every (token, expert) pair is sorted by expert so each active expert runs one GEMM over
    all its tokens; results are weighted and scatter-added back to their tokens. On CUDA the same
    contract runs as two grouped-GEMM Triton kernels (backend/kernels/moe_triton.py); gpt-oss's experts run this
    loop there too.
    """
    plain = b_gate_up is None and b_down is None and clamped_swiglu is None
    if use_triton(x) and plain:
        from backend.kernels import moe_triton

        return moe_triton.fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids)
    weights = topk_weights.flatten()
    out = torch.zeros_like(x)
    for expert, pairs, tokens in expert_groups(topk_ids, w_gate_up.shape[0]):
        gate_up = F.linear(x[tokens], w_gate_up[expert], None if b_gate_up is None else b_gate_up[expert])
        if clamped_swiglu is None:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        else:
            hidden = swiglu_clamped(gate_up, *clamped_swiglu)
        y = F.linear(hidden, w_down[expert], None if b_down is None else b_down[expert])
        y = y * weights[pairs, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def swiglu_clamped(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation of [..., 2I] (gate columns, then up): the gate clamped to at most limit, up to
    [-limit, limit], then gate * sigmoid(alpha * gate) * (up + 1), in transformers' order of operations."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


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
