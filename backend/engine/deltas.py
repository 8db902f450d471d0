"""What a step changes in a sequence's output: its tokens appended, detokenized and checked against the
stops, then handed on as deltas; cumulative outputs are assembled from deltas where a caller wants them.

Text that could be the start of a stop string is held back until it cannot be (the stop string itself is
never part of the output), so a delta's text is always final.

add_logprob, append_token and record_prompt_logprobs are postprocess's (Scheduler.postprocess calls them, and
nothing else does); taking deltas reads a sequence and keeps how far it has gone in a Handed of its own.
"""

from dataclasses import dataclass, replace

import torch

from backend.engine.sequence import Sequence
from backend.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass
class RequestDelta:
    request_id: str
    # the sequences this step changed, each as vLLM's delta outputs are: the tokens generated since the last
    # delta, the text that became final since then, the new tokens' logprobs (cumulative_logprob is the total)
    outputs: list[CompletionOutput]
    finished: bool = False  # every sequence of the request has finished
    error: str | None = None  # processing the request failed; its sequences end with finish_reason "error"
    num_cached_tokens: int = 0
    embeddings: list[torch.Tensor] | None = None  # an embeddings request's vectors, in its last delta
    # asked for: the prompt's logprobs, once, in the delta of the step that finished computing the prompt
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error_param: str | None = None  # the request's setting at fault, when its own input made it fail


def add_logprob(seq: Sequence, token: int, entry: dict[int, Logprob]) -> None:
    """The logprob entry of a token about to be appended (append_token decodes its tokens' text)."""
    if seq.logprobs is None:
        seq.logprobs = []
    seq.logprobs.append(entry)
    seq.cumulative_logprob += entry[token].logprob


def append_token(
    seq: Sequence, token: int, eos_token_ids: set[int], max_model_len: int, tokenizer=None
) -> tuple[str, int | str | None] | None:
    """Add one generated token; returns (finish_reason, stop_reason) when it ends the sequence."""
    seq.token_ids.append(token)
    if seq.matcher is not None and not seq.matcher.accept_token(token):
        raise RuntimeError(f"token {token} does not continue the output's grammar")
    p = seq.params
    at = seq.num_output_tokens - 1  # this token's entry, added just before it (add_logprob)
    if seq.logprobs and tokenizer is not None and at < len(seq.logprobs):
        for tid, lp in seq.logprobs[at].items():
            lp.decoded_token = tokenizer.decode([tid])
    delta = seq.detokenizer.add(token) if seq.detokenizer is not None else ""
    stop_token = token in p.stop_token_ids or (token in eos_token_ids and not p.ignore_eos)
    # A grammar that has ended (it accepted a stop token) admits nothing more: it ends the output even
    # under ignore_eos.
    if stop_token or (seq.matcher is not None and seq.matcher.is_terminated()):
        return "stop", token
    if delta and p.stop:
        stop = _find_stop_string(seq, len(delta))
        if stop is not None:
            return "stop", stop
    if (
        p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens
    ) or seq.num_tokens >= max_model_len:
        return "length", None
    return None


def record_prompt_logprobs(
    seq: Sequence, first: int, entries: list[dict[int, Logprob]], tokenizer=None
) -> None:
    """Store a chunk's prompt logprobs (engine/prompt_logprobs.py) from prompt token `first` on, each entry's
    tokens decoded; a chunk computed again (after preemption) overwrites its own."""
    for i, entry in enumerate(entries, start=first):
        if tokenizer is not None:
            for tid, lp in entry.items():
                lp.decoded_token = tokenizer.decode([tid])
        seq.prompt_logprobs[i] = entry


def _find_stop_string(seq: Sequence, delta_len: int) -> str | None:
    """The earliest stop string the new text completes; the text is cut where it begins."""
    text = seq.detokenizer.text
    longest = max(len(s) for s in seq.params.stop)
    search_from = max(0, len(text) - delta_len - longest + 1)
    found = [(pos, s) for pos, s in ((text.find(s, search_from), s) for s in seq.params.stop) if pos >= 0]
    if not found:
        return None
    pos, stop = min(found)
    seq.detokenizer.text = text[:pos]
    return stop


@dataclass
class Handed:
    """How far one sequence's deltas have gone: output tokens and characters of text handed out, and whether its
    prompt logprobs were. The deltas' own record, so that a Sequence is written by postprocess alone."""

    tokens: int = 0
    chars: int = 0
    prompt_logprobs: bool = False


def take_delta(seq: Sequence, handed: Handed) -> CompletionOutput | None:
    """What the sequence gained since the last delta (None if nothing that can be handed out yet)."""
    text = seq.text
    if seq.finished:
        end = len(text)
    else:
        hold = max((len(s) for s in seq.params.stop), default=1) - 1
        end = max(handed.chars, len(text) - hold)
    new_tokens = seq.output_token_ids[handed.tokens :]
    if not new_tokens and end == handed.chars and not seq.finished:
        return None
    delta = CompletionOutput(
        index=seq.index,
        token_ids=new_tokens,
        text=text[handed.chars : end],
        logprobs=seq.logprobs[handed.tokens :] if seq.logprobs is not None else None,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
    )
    handed.tokens += len(new_tokens)
    handed.chars = end
    return delta


def request_delta(request_id: str, seqs: list[Sequence], handed: list[Handed]) -> RequestDelta:
    """What a generation request's sequences gained since its last delta, and whether it has ended."""
    changed = [d for d in map(take_delta, seqs, handed) if d is not None]
    failed = next((s for s in seqs if s.error), None)
    return RequestDelta(
        request_id,
        changed,
        all(s.finished for s in seqs),
        failed and failed.error,
        seqs[0].num_cached_tokens or 0,
        prompt_logprobs=take_prompt_logprobs(seqs[0], handed[0]),
        error_param=failed and failed.error_param,
    )


def take_prompt_logprobs(seq: Sequence, handed: Handed) -> list[dict[int, Logprob] | None] | None:
    """The prompt's logprobs once they are all computed (a token has been generated after the prompt), the first
    time they are asked for (None otherwise)."""
    if seq.prompt_logprobs is None or handed.prompt_logprobs or seq.num_output_tokens == 0:
        return None
    handed.prompt_logprobs = True
    return seq.prompt_logprobs


class OutputAssembler:
    """Cumulative RequestOutputs (vLLM's shape) from one request's deltas."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], n: int):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.choices = [CompletionOutput(index=i, text="", token_ids=[]) for i in range(n)]
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.finished = False
        self.error: str | None = None
        self.error_param: str | None = None

    def add(self, delta: RequestDelta) -> None:
        for d in delta.outputs:
            c = self.choices[d.index]
            c.token_ids.extend(d.token_ids)
            c.text += d.text
            if d.logprobs is not None:
                c.logprobs = (c.logprobs or []) + d.logprobs
            c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
            if d.cumulative_logprob is not None:
                c.cumulative_logprob = d.cumulative_logprob
        self.finished, self.error, self.error_param = delta.finished, delta.error, delta.error_param
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs

    def output(self) -> RequestOutput:
        """A snapshot: later deltas do not change it (add() rebinds text and logprobs, and token_ids is copied)."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[replace(c, token_ids=list(c.token_ids)) for c in self.choices],
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            error=self.error,
            prompt_logprobs=self.prompt_logprobs,
            error_param=self.error_param,
        )
