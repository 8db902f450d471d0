"""Lossless verification of drafted tokens against the target's distributions.

For draft i with proposal probability q(x) and target probability p(x): accept with
probability min(1, p(x)/q(x)); on the first rejection sample from norm(max(0, p - q)) and
stop; when every draft is accepted, take a bonus token from the target's next distribution.
The tokens that come out are distributed exactly as the target alone would sample them
(Leviathan et al. 2023, Chen et al. 2023). Greedy requests accept while the target's argmax
agrees. p is the target's distribution after the request's penalties, temperature, top-k,
top-p and min-p, computed at each position with the drafts before it in the history.
"""

import torch

from backend.engine.sampler import apply_penalties, has_penalties, sampling_probs
from backend.engine.sequence import Sequence


def accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """targets: the target's argmax at the last known token and after each draft."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return drafts[:accepted] + [targets[accepted]]


def verify(logits: torch.Tensor, seq: Sequence, generator: torch.Generator) -> list[int]:
    """logits [k+1, V]: the target at the last known token and at each of the k drafts.

    Returns the tokens to append: the accepted drafts and one more (a correction or a bonus).
    """
    drafts = seq.draft_tokens
    params = seq.params
    k = len(drafts)
    logits = logits.cpu()  # plain greedy requests are accepted from argmaxes before they get here
    if has_penalties(params):
        logits = logits.clone()
        apply_penalties(logits, [(params, seq.token_ids + drafts[:j], seq.num_prompt_tokens) for j in range(k + 1)])
    if params.greedy:
        return accept_greedy(drafts, logits.argmax(dim=-1).tolist())
    p = sampling_probs(logits, [params] * (k + 1))
    p = p / p.sum(dim=-1, keepdim=True)
    q = seq.draft_probs
    accepted_tokens = []
    for j, x in enumerate(drafts):
        q_x = 1.0 if q is None else q[j, x].item()
        u = torch.rand(1, generator=generator).item()
        if u * q_x < p[j, x].item():
            accepted_tokens.append(x)
            continue
        if q is None:
            residual = p[j].clone()
            residual[x] = 0.0
        else:
            residual = (p[j] - q[j]).clamp_min(0.0)
        if residual.sum() <= 0:  # p == q up to rounding: nothing to correct towards
            residual = p[j]
        return accepted_tokens + [int(torch.multinomial(residual, 1, generator=generator))]
    return accepted_tokens + [int(torch.multinomial(p[k], 1, generator=generator))]
