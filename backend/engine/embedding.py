"""Embeddings: each input's last hidden state (after the final norm), mean-pooled over its tokens and
L2-normalised.

Each input is a sequence of its own (pooling) that the scheduler runs like a prompt that is never sampled
from: admitted in turn with other requests' sequences, its chunks computed between decode steps within
the step's token budget, its KV blocks taken and freed like any prompt's (never entering the prefix cache:
every row's hidden state is needed, so it computes its whole input), and aborting its request frees them.
The runner returns each chunk's sum of hidden rows; postprocess adds them up and, after the last chunk,
divides and normalises. The request's outputs are handed out once every input is done.
"""

from collections.abc import Iterator

import torch

from backend.engine.deltas import RequestDelta
from backend.engine.sequence import Sequence
from backend.outputs import CompletionOutput
from backend.sampling_params import SamplingParams

POOLING = {"pooling": "mean", "normalized": True, "source": "last hidden state"}


def embedding_sequences(request_id: str, inputs: list[list[int]], seq_ids: Iterator[int]) -> list[Sequence]:
    """One pooling sequence per input of token ids (already checked: admission.Limits.check_embedding)."""
    params = SamplingParams(max_tokens=1)
    # num_cached_tokens 0: it never looks up the prefix cache, so it does not count in its statistics
    return [
        Sequence(
            seq_id=next(seq_ids),
            request_id=request_id,
            index=i,
            token_ids=list(ids),
            num_prompt_tokens=len(ids),
            params=params,
            pooling=True,
            num_cached_tokens=0,
        )
        for i, ids in enumerate(inputs)
    ]


def add_rows(total: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    return part if total is None else total + part


def mean_vector(total: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The normalised mean of an input's hidden rows (float32, on the CPU) from their sum."""
    return torch.nn.functional.normalize(total / num_tokens, dim=0).cpu()


def embedding_delta(request_id: str, seqs: list[Sequence]) -> RequestDelta | None:
    """The request's vectors once every input has finished (None until then: nothing to hand out before)."""
    if not all(s.finished for s in seqs):
        return None
    error = next((s.error for s in seqs if s.error), None)
    outputs = [CompletionOutput(s.index, "", [], finish_reason=s.finish_reason) for s in seqs]
    embeddings = None if error or any(s.embedding is None for s in seqs) else [s.embedding for s in seqs]
    return RequestDelta(request_id, outputs, True, error, embeddings=embeddings)
