"""The gated delta rule of Gated DeltaNet layers (Qwen3-Next, Qwen3.5), in float32.

The state S of a value head is a [key_dim, value_dim] matrix. A token with (normalised) key k, value v, query q,
decay a = exp(g) and write strength beta updates it as
    S <- a S + k (beta (v - a S^T k))^T        (the delta rule: only what a S does not already predict is written)
and reads o = S^T q. recurrent_step takes one token of many sequences (decoding); chunked takes a run of tokens of
one sequence (a prompt chunk) from a given state, as matrix products over chunks of CHUNK tokens: within a chunk
the writes d_t solve a unit lower-triangular system, since each token's write depends on the earlier ones'.
Both L2-normalise q and k and scale q by key_dim ** -0.5, as the models do.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backend.kernels import native

CHUNK = 64


@dataclass(frozen=True)
class StateRows:
    """Which state each row of a step reads (AttentionMetadata.states): the slot of each decode row's sequence,
    then of each prompt chunk's, and per prompt chunk whether it verifies drafts (its state is kept as it was
    until the accepted rows are known: GatedDeltaNet.commit)."""

    slots: torch.Tensor
    drafts: tuple[bool, ...] = ()


_EPS = 1e-6  # the models' L2-norm epsilon, under the square root


def _normalise(
    q: torch.Tensor, k: torch.Tensor, num_value_heads: int, tiled: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k [..., num_key_heads, key_dim] L2-normed, q scaled, each key head repeated for the value heads it
    serves: consecutive value heads share a key head, or (tiled) value head h reads key head h % num_key_heads."""
    q, k = q.float(), k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + _EPS) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + _EPS)
    repeat = num_value_heads // k.shape[-2]
    if repeat > 1 and tiled:
        times = [1] * (k.dim() - 2) + [repeat, 1]
        q, k = q.repeat(*times), k.repeat(*times)
    elif repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=-2), k.repeat_interleave(repeat, dim=-2)
    return q, k


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    tiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: q, k [B, Hk, Dk], v [B, Hv, Dv], g (log decay) and beta [B, Hv], state
    [B, Hv, Dk, Dv] fp32; tiled: the value heads' order (_normalise). Returns (output [B, Hv, Dv] fp32, the new
    state)."""
    q, k = _normalise(q, k, v.shape[-2], tiled)
    dk, dv = state.shape[-2:]
    s = state * g.float().exp()[..., None, None]
    predicted = (k.unsqueeze(-2) @ s).squeeze(-2)
    write = (v.float() - predicted) * beta.float()[..., None]
    # the rank-1 write as a batched product in place: a broadcast outer product and sum is 30x slower here
    s.view(-1, dk, dv).baddbmm_(k.reshape(-1, dk, 1), write.reshape(-1, 1, dv))
    return (q.unsqueeze(-2) @ s).squeeze(-2), s


def recurrent_in_pool(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    tiled: bool = False,
    run: bool = False,
) -> torch.Tensor:
    """The rule's rows on states that are slots of a pool [num_slots, Hv, Dk, Dv] fp32, read and written in place:
    decode rows (row i's state is states[slots[i]], started from zeros where fresh[i]), or with run one sequence's
    run of tokens from states[slots[0]] (zeros where fresh[0]). Returns the output [rows, Hv, Dv] fp32.
    Our C kernel on the CPU (cpu_delta_rule.c: the recurrent form, a run token by token with each block of the state
    kept in cache); else the torch step between a gather and a scatter, or for a run the chunked form. A run of one
    chunk or less takes the chunked form too: its rounding follows transformers' own (the recurrent form's differs
    from it by as much as transformers' fp32 differs from float64, 1.5e-4 in a tiny model's logits)."""
    short_run = run and q.shape[0] <= CHUNK
    if short_run or not (native.usable(states) and states.is_contiguous()):
        if run:
            slot = int(slots[0])
            out, states[slot] = chunked(q, k, v, g, beta, None if fresh[0] else states[slot], tiled=tiled)
            return out
        state = torch.where(fresh[:, None, None, None], 0.0, states.index_select(0, slots))
        out, state = recurrent_step(q, k, v, g, beta, state, tiled)
        states.index_copy_(0, slots, state)
        return out
    # the kernel finds each value head's key head itself in the checkpoints' order; tiled, each value head gets
    # its own copy of its key head here
    q, k = _normalise(q, k, v.shape[-2] if tiled else k.shape[-2], tiled)
    rows, hv, dv = v.shape
    out = torch.empty(rows, hv, dv)
    args = [x.float().contiguous() for x in (q, k, v, g, beta)]
    widths = (k.shape[-2], hv, states.shape[-2], dv, torch.get_num_threads())
    if run:
        state = states[int(slots[0])]
        if fresh[0]:
            state.zero_()
        native.library().delta_rule_run(
            *(x.data_ptr() for x in args), state.data_ptr(), out.data_ptr(), rows, *widths
        )
        return out
    slots, fresh = slots.contiguous(), fresh.to(torch.uint8).contiguous()
    native.library().delta_rule_rows(
        *(x.data_ptr() for x in args),
        states.data_ptr(),
        slots.data_ptr(),
        fresh.data_ptr(),
        out.data_ptr(),
        rows,
        *widths,
    )
    return out


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk: int = CHUNK,
    tiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens of one sequence: q, k [T, Hk, Dk], v [T, Hv, Dv], g and beta [T, Hv], state [Hv, Dk, Dv] fp32 or
    None (zeros); tiled: the value heads' order (_normalise). Returns (output [T, Hv, Dv] fp32, the state after the
    last token)."""
    t, hv, dv = v.shape
    q, k = _normalise(q, k, hv, tiled)
    dk = k.shape[-1]
    pad = (-t) % chunk
    # [Hv, N, C, ...]: heads first, then chunks of C tokens; padding tokens have zero key, value and beta and no
    # decay, so they change neither the state nor the real tokens' outputs
    q, k, v = (
        F.pad(x, (0, 0, 0, 0, 0, pad)).permute(1, 0, 2).reshape(hv, -1, chunk, x.shape[-1])
        for x in (q, k, v.float())
    )
    g, beta = (F.pad(x.float(), (0, 0, 0, pad)).t().reshape(hv, -1, chunk) for x in (g, beta))
    log_decay = g.cumsum(-1)  # [Hv, N, C]: log of the decay from the chunk's start through token i
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # ratio[i, j] = decay from token j (exclusive) through i, for j <= i; 0 above the diagonal
    ratio = (log_decay[..., :, None] - log_decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kk = k @ k.transpose(-1, -2)
    system = (kk * ratio * beta[..., :, None]).tril(-1)  # strictly lower: the earlier writes' reach
    system = system + torch.eye(chunk, device=q.device)
    # writes d = W_v - W_k S0 (S0: the state entering the chunk), from (I + A) d = beta v - beta decay k S0
    # one solve for both right-hand sides: torch's batched triangular solve costs per call on the CPU
    rhs = torch.cat([v * beta[..., None], k * (beta * log_decay.exp())[..., None]], dim=-1)
    w_v, w_k = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split(
        [dv, dk], dim=-1
    )
    attend = (q @ k.transpose(-1, -2)) * ratio  # within the chunk, causal, decayed
    q_decayed = q * log_decay.exp()[..., None]
    k_to_end = k * (log_decay[..., -1:] - log_decay).exp()[..., None]
    chunk_decay = log_decay[..., -1].exp()[..., None, None]  # [Hv, N, 1, 1]
    s = torch.zeros(hv, dk, dv, device=q.device) if state is None else state.float()
    out = torch.empty_like(v)
    for n in range(v.shape[1]):
        writes = w_v[:, n] - w_k[:, n] @ s
        out[:, n] = q_decayed[:, n] @ s + attend[:, n] @ writes
        s = s * chunk_decay[:, n] + k_to_end[:, n].transpose(-1, -2) @ writes
    return out.reshape(hv, -1, dv)[:, :t].transpose(0, 1), s
