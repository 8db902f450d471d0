"""Turns the logits of a batch into one next token per sequence, each with its own settings.

Order (as in vLLM): penalties, then greedy argmax or temperature, top-k, top-p, min-p and a
draw. The draw is argmax(p / E) with E ~ Exponential(1) per vocabulary entry, which picks
token i with probability p_i / sum(p); each seeded sequence draws E from its own generator,
so its output does not depend on what else shares the batch.
"""

import torch

from backend.engine.sequence import Sequence
from backend.outputs import Logprob
from backend.sampling_params import SamplingParams


def apply_penalties(logits: torch.Tensor, rows: list[tuple[SamplingParams, list[int], int]]) -> None:
    """In place. Each row: (params, every token so far, how many of them are the prompt).

    Repetition penalty over prompt and output tokens, then frequency and presence over output tokens.
    """
    vocab = logits.shape[1]
    for row, (p, token_ids, num_prompt) in enumerate(rows):
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool)
            seen[torch.tensor(token_ids, dtype=torch.long)] = True
            x = logits[row]
            logits[row] = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
        if (p.frequency_penalty or p.presence_penalty) and len(token_ids) > num_prompt:
            counts = torch.bincount(torch.tensor(token_ids[num_prompt:], dtype=torch.long), minlength=vocab)[:vocab]
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1 or bool(p.frequency_penalty) or bool(p.presence_penalty)


def needs_only_argmax(seq: Sequence) -> bool:
    """Greedy with nothing that reads the whole distribution: its token is the argmax of the raw logits,
    which is all that has to leave the device."""
    p = seq.params
    return p.greedy and p.logprobs is None and not has_penalties(p) and seq.matcher is None


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each (non-greedy) row samples from: temperature, then top-k, top-p, min-p (unnormalised)."""
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    return filter_probs(
        probs,
        torch.tensor([p.top_k for p in params]),
        torch.tensor([p.top_p for p in params], dtype=logits.dtype),
        torch.tensor([p.min_p for p in params], dtype=logits.dtype),
    )


def filter_probs(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens that top-k (k=0: off), then top-p over what is left, then min-p rule out."""
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k, probs.shape[1]).clamp(max=probs.shape[1])
        kth = torch.sort(probs, dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        probs = probs.masked_fill(probs < kth, 0.0)
    if bool((top_p < 1).any()):
        probs = probs / probs.sum(dim=-1, keepdim=True)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p[:, None]  # the smallest set whose mass reaches top_p stays
        probs = probs.masked_fill(drop_sorted.scatter(1, order, drop_sorted), 0.0)
    if bool((min_p > 0).any()):
        top = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < min_p[:, None] * top, 0.0)
    return probs


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)  # for requests without a seed
        self.guided = None  # a GuidedDecoding, set by the engine once a request asks for structured output

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits [N, V] fp32; fills each sequence's logprobs when asked; returns N token ids."""
        logits = logits.cpu()  # per-request generators, penalties and grammars work on the host
        want_logprobs = [s.params.logprobs is not None for s in seqs]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        if any(has_penalties(s.params) for s in seqs):
            logits = logits.clone()
            apply_penalties(logits, [(s.params, s.token_ids, s.num_prompt_tokens) for s in seqs])
        if self.guided is not None and any(s.matcher is not None for s in seqs):
            logits = logits.clone()
            self.guided.mask(logits, [s.matcher for s in seqs])
        tokens = logits.argmax(dim=-1)
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if rows:
            tokens[rows] = self._draw(logits[rows], [seqs[i] for i in rows])
        token_list = tokens.tolist()
        if raw_logprobs is not None:
            for row, seq in enumerate(seqs):
                if want_logprobs[row]:
                    self.record_logprobs(seq, raw_logprobs[row], token_list[row])
        return token_list

    def generator_for(self, seq: Sequence) -> torch.Generator:
        return seq.generator if seq.generator is not None else self.generator

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        probs = sampling_probs(logits, [s.params for s in seqs])
        noise = torch.empty_like(probs)
        unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1]).exponential_(generator=self.generator)
        for i, s in enumerate(seqs):
            if s.generator is not None:
                noise[i].exponential_(generator=s.generator)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def record_logprobs(seq: Sequence, logprobs: torch.Tensor, token: int) -> None:
        chosen = logprobs[token].item()
        entry = {token: Logprob(chosen, int((logprobs > chosen).sum().item()) + 1)}
        if seq.params.logprobs:
            values, ids = torch.topk(logprobs, seq.params.logprobs)
            for rank, (value, tid) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
                entry.setdefault(tid, Logprob(value, rank))
        if seq.logprobs is None:
            seq.logprobs = []
        seq.logprobs.append(entry)
        seq.cumulative_logprob += chosen
