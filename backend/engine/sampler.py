"""Turns logits into tokens, each sequence with its own settings, on the logits' device.

Order (as in vLLM): penalties, then greedy argmax or temperature, top-k, top-p, min-p and a
draw. The draw is argmax(p / E) with E ~ Exponential(1) per vocabulary entry, which picks
token i with probability p_i / sum(p); each seeded sequence draws E from its own generator,
so its output does not depend on what else shares the batch. The same distribution and draw
serve plain sampling, the draft model's proposals and the verification of drafts; only token
ids (and logprobs where asked) leave the device.
"""

import threading
from collections.abc import Callable

import torch

from backend.engine.guided import GuidedDecoding
from backend.engine.sequence import Sequence
from backend.outputs import Logprob
from backend.sampling_params import InvalidParameter, SamplingParams

LogprobEntry = dict[int, Logprob]  # a sampled token's logprob and rank, and the `logprobs` most likely tokens'


def apply_penalties(logits: torch.Tensor, rows: list[tuple[SamplingParams, list[int], int]]) -> None:
    """In place. Each row: (params, every token so far, how many of them are the prompt).

    Repetition penalty over prompt and output tokens, then frequency and presence over output tokens.
    """
    vocab, device = logits.shape[1], logits.device
    for row, (p, token_ids, num_prompt) in enumerate(rows):
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            seen[torch.tensor(token_ids, dtype=torch.long, device=device)] = True
            x = logits[row]
            logits[row] = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
        if (p.frequency_penalty or p.presence_penalty) and len(token_ids) > num_prompt:
            output = torch.tensor(token_ids[num_prompt:], dtype=torch.long, device=device)
            counts = torch.bincount(output, minlength=vocab)[:vocab]
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1 or bool(p.frequency_penalty) or bool(p.presence_penalty)


def apply_logit_bias(logits: torch.Tensor, biases: list[dict[int, float] | None]) -> None:
    """In place: each row's biases added to its tokens' logits, in one scatter for the batch."""
    rows, ids, values = [], [], []
    for row, bias in enumerate(biases):
        for token, value in (bias or {}).items():
            rows.append(row)
            ids.append(token)
            values.append(value)
    device = logits.device
    logits.index_put_((torch.tensor(rows, device=device), torch.tensor(ids, device=device)),
                      torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)


def needs_only_argmax(seq: Sequence) -> bool:
    """Greedy with nothing that reads the whole distribution: its token is the argmax of the raw logits,
    which is all that has to leave the device."""
    p = seq.params
    return (p.greedy and p.logprobs is None and not has_penalties(p) and seq.matcher is None and not p.logit_bias
            and p.allowed_token_ids is None)


def keep_allowed(logits: torch.Tensor, allowed: list[list[int] | None]) -> None:
    """In place: in each row with a list of allowed tokens, every other token's logit set to -inf."""
    for row, ids in enumerate(allowed):
        if ids is not None:
            mask = torch.ones(logits.shape[1], dtype=torch.bool, device=logits.device)
            mask[torch.tensor(ids, device=logits.device)] = False
            logits[row].masked_fill_(mask, float("-inf"))


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each (non-greedy) row samples from: temperature, then top-k, top-p, min-p (unnormalised)."""
    device, dtype = logits.device, logits.dtype
    temperature = torch.tensor([p.temperature for p in params], dtype=dtype, device=device)
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    return filter_probs(probs, torch.tensor([p.top_k for p in params], device=device),
                        torch.tensor([p.top_p for p in params], dtype=dtype, device=device),
                        torch.tensor([p.min_p for p in params], dtype=dtype, device=device),
                        any(p.top_k for p in params), any(p.top_p < 1 for p in params), any(p.min_p for p in params))


def filter_probs(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                 use_k: bool = True, use_p: bool = True, use_min_p: bool = True) -> torch.Tensor:
    """Zero the tokens that top-k (k=0: off), then top-p over what is left, then min-p rule out. use_*: whether
    any row has that filter (known on the host, so the device is never asked)."""
    if use_k:
        k = torch.where(top_k > 0, top_k, probs.shape[1]).clamp(max=probs.shape[1])
        kth = torch.sort(probs, dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        probs = probs.masked_fill(probs < kth, 0.0)
    if use_p:
        probs = probs / probs.sum(dim=-1, keepdim=True)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p[:, None]  # the smallest set whose mass reaches top_p stays
        probs = probs.masked_fill(drop_sorted.scatter(1, order, drop_sorted), 0.0)
    if use_min_p:
        top = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < min_p[:, None] * top, 0.0)
    return probs


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu",
                 make_guided: Callable[[], GuidedDecoding] | None = None):
        self.generator = torch.Generator(device=device).manual_seed(seed)  # for requests without a seed
        # Structured output's grammars, made by make_guided when a request first asks for them (guided_decoding)
        self.make_guided = make_guided
        self.guided: GuidedDecoding | None = None
        self._guided_lock = threading.Lock()

    def guided_decoding(self) -> GuidedDecoding:
        """The grammars (made on first use). Thread-safe: the server compiles schemas off the engine thread."""
        with self._guided_lock:
            if self.guided is None:
                if self.make_guided is None:
                    raise ValueError("this sampler was made without structured output")
                self.guided = self.make_guided()
            return self.guided

    def generator_for(self, seq: Sequence) -> torch.Generator:
        return seq.generator if seq.generator is not None else self.generator

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[LogprobEntry | None]]:
        """logits [N, V] fp32, one row per sequence: N token ids, and each one's logprob entry where its request
        asks for logprobs (None otherwise). Nothing of the sequences is written but their generators' state."""
        want_logprobs = [s.params.logprobs is not None for s in seqs]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        logits = self.processed(logits, seqs, [s.token_ids for s in seqs])
        tokens = logits.argmax(dim=-1)
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if rows:
            probs = sampling_probs(logits[rows], [seqs[i].params for i in rows])
            tokens[rows] = self.draw(probs, [seqs[i] for i in rows])
        token_list = tokens.tolist()
        entries = [logprob_entry(raw_logprobs[row], token_list[row], seq.params.logprobs) if want_logprobs[row]
                   else None for row, seq in enumerate(seqs)]
        return token_list, entries

    def processed(self, logits: torch.Tensor, seqs: list[Sequence], histories: list[list[int]]) -> torch.Tensor:
        """Logits after each row's logit_bias, allowed tokens, penalties (over its history) and grammar mask; a copy
        where any applies."""
        if any(s.params.logit_bias for s in seqs):
            logits = logits.clone()
            apply_logit_bias(logits, [s.params.logit_bias for s in seqs])
        if any(s.params.allowed_token_ids is not None for s in seqs):
            logits = logits.clone()
            keep_allowed(logits, [s.params.allowed_token_ids for s in seqs])
        if any(has_penalties(s.params) for s in seqs):
            logits = logits.clone()
            apply_penalties(logits, [(s.params, h, s.num_prompt_tokens) for s, h in zip(seqs, histories)])
        if self.guided is not None and any(s.matcher is not None for s in seqs):
            logits = logits.clone()
            self.guided.mask(logits, [s.matcher for s in seqs])
            _check_some_token_left(logits, seqs)
        return logits

    def draw(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """One token per row of (unnormalised) probabilities, with each sequence's generator."""
        noise = torch.empty_like(probs)
        unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(
                generator=self.generator)
        for i, s in enumerate(seqs):
            if s.generator is not None:
                noise[i].exponential_(generator=s.generator)
        return (probs / noise).argmax(dim=-1)

    def uniform(self, seq: Sequence, device: torch.device) -> float:
        return torch.rand(1, generator=self.generator_for(seq), device=device).item()


def _check_some_token_left(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """A request whose allowed_token_ids leave none of the tokens its grammar allows next cannot go on: its own
    settings contradict each other (an InvalidParameter, the client's to change), not a fault of the engine."""
    rows = [i for i, s in enumerate(seqs) if s.matcher is not None and s.params.allowed_token_ids is not None]
    if not rows:
        return
    # masked tokens are -inf; a NaN row is a numerical fault, not the request's, and is left to fail as one
    for i, left in zip(rows, (~torch.isneginf(logits[rows])).any(dim=-1).tolist()):
        if not left:
            raise InvalidParameter("allowed_token_ids", f"allowed_token_ids leaves no token that the output's JSON "
                                   f"schema (response_format, or a required tool call) allows after "
                                   f"{seqs[i].num_output_tokens} generated tokens; allow the tokens the schema "
                                   "needs, or drop one of the two")


def logprob_entry(logprobs: torch.Tensor, token: int, top: int | None) -> LogprobEntry:
    """The entry of `token` drawn from a row of raw log-probabilities."""
    chosen = logprobs[token].item()
    entry = {token: Logprob(chosen, int((logprobs > chosen).sum().item()) + 1)}
    if top:
        values, ids = torch.topk(logprobs, top)
        for rank, (value, tid) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
            entry.setdefault(tid, Logprob(value, rank))
    return entry
