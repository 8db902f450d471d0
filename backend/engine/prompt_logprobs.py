"""Prompt logprobs (vLLM's prompt_logprobs; echo with logprobs in the legacy completions API): the logprob of
each prompt token given the tokens before it, read off the hidden rows the prefill computes anyway.

A chunk's row at position p predicts token p + 1, so a chunk gives the entries of the prompt tokens after
its rows, up to the last prompt token (whose row predicts the first generated token, sampled as usual).
A request that asks for them skips the prefix cache (scheduler.py): every prompt row is computed, so a
cached prompt gives the same numbers as a fresh one.
"""

from collections.abc import Callable

import torch

from backend.engine.scheduler import ScheduledSeq
from backend.outputs import Logprob

# Logits for this many rows at a time: a whole 2,048-token chunk over a 150k vocabulary would be 1.2 GB.
ROWS_PER_SLICE = 128

PromptLogprobs = list[dict[int, Logprob] | None]  # one entry per prompt token, the first None


def chunk_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                          item: ScheduledSeq) -> tuple[int, list[dict[int, Logprob]]]:
    """(the index of the first prompt token they are for, the entries) from the item's rows of hidden states:
    each the token's own logprob and rank, and the `prompt_logprobs` most likely tokens besides."""
    seq, top = item.seq, item.seq.params.prompt_logprobs
    start = seq.num_computed_tokens
    end = min(start + item.num_scheduled_tokens, seq.num_prompt_tokens - 1)  # positions whose next token is in the prompt
    rows = hidden[:end - start]
    targets = torch.tensor(seq.token_ids[start + 1:end + 1], dtype=torch.long, device=hidden.device)
    entries: list[dict[int, Logprob]] = []
    for a in range(0, end - start, ROWS_PER_SLICE):
        logprobs = torch.log_softmax(compute_logits(rows[a:a + ROWS_PER_SLICE]).float(), dim=-1)
        wanted = targets[a:a + ROWS_PER_SLICE]
        chosen = logprobs.gather(1, wanted[:, None])
        ranks = (logprobs > chosen).sum(dim=1) + 1
        best = torch.topk(logprobs, top, dim=-1) if top else None
        tops = zip(best.values.tolist(), best.indices.tolist()) if best is not None else ([([], [])] * len(wanted))
        for token, value, rank, (values, ids) in zip(wanted.tolist(), chosen[:, 0].tolist(), ranks.tolist(), tops):
            entry = {token: Logprob(value, rank)}
            for r, (v, tid) in enumerate(zip(values, ids), start=1):
                entry.setdefault(tid, Logprob(v, r))
            entries.append(entry)
    return start + 1, entries

