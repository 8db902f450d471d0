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

from backend.engine.sampler import LogprobEntry, Sampler, logprob_entry, sampling_probs
from backend.engine.scheduler import ScheduledSeq


def accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """targets: the target's argmax at the last known token and after each draft."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return drafts[:accepted] + [targets[accepted]]


def verify(logits: torch.Tensor, item: ScheduledSeq, sampler: Sampler
           ) -> tuple[list[int], list[LogprobEntry] | None]:
    """logits [k+1, V]: the target at the last known token and at each of the k drafts. Returns the tokens
    to append (the accepted drafts and one more: a correction or a bonus), and their logprob entries if asked."""
    seq, drafts, q = item.seq, item.draft_tokens, item.draft_probs
    params, k = seq.params, len(item.draft_tokens)
    processed = sampler.processed(logits, [seq] * (k + 1), [seq.token_ids + drafts[:j] for j in range(k + 1)])
    if params.greedy:
        tokens = accept_greedy(drafts, processed.argmax(dim=-1).tolist())
    else:
        p = sampling_probs(processed, [params] * (k + 1))
        p = p / p.sum(dim=-1, keepdim=True)
        tokens = _accept_sampled(p, drafts, q, item, sampler)
    if params.logprobs is None:
        return tokens, None
    raw = torch.log_softmax(logits, dim=-1)
    return tokens, [logprob_entry(raw[j], token, params.logprobs) for j, token in enumerate(tokens)]


def _accept_sampled(p: torch.Tensor, drafts: list[int], q: torch.Tensor | None, item: ScheduledSeq,
                    sampler: Sampler) -> list[int]:
    seq = item.seq
    accepted = []
    for j, x in enumerate(drafts):
        q_x = 1.0 if q is None else q[j, x].item()
        if sampler.uniform(seq, p.device) * q_x < p[j, x].item():
            accepted.append(x)
            continue
        if q is None:
            residual = p[j].clone()
            residual[x] = 0.0
        else:
            residual = (p[j] - q[j]).clamp_min(0.0)
        if residual.sum() <= 0:  # p == q up to rounding: nothing to correct towards
            residual = p[j]
        return accepted + [int(sampler.draw(residual[None], [seq])[0])]
    return accepted + [int(sampler.draw(p[len(drafts)][None], [seq])[0])]
