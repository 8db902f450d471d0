"""One generated continuation of a request (a request with n > 1 has n sequences)."""

import enum
from dataclasses import dataclass, field

import torch

from backend.detokenizer import IncrementalDetokenizer
from backend.outputs import Logprob
from backend.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n outputs this is
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None = None
    generator: torch.Generator | None = None  # set when the request is seeded
    # n > 1: the siblings that take this sequence's KV once its prompt is prefilled (prefilled once for all)
    forks: list["Sequence"] = field(default_factory=list)
    matcher: object | None = None  # structured output: which tokens may come next (xgrammar)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache at first admission (-1: not yet)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chain hashes of the leading full blocks
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None  # why processing this sequence failed (finish_reason "error")
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    # Speculative decoding: tokens proposed for this step, and the proposer's distribution for each
    # ([k, vocab]; None for deterministic proposals such as n-gram lookup or greedy drafts).
    draft_tokens: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    acceptance: float = 0.6  # running per-token acceptance rate, which sets k in "auto" mode
    idle_steps: int = 0  # steps since the last proposal, to probe again after a cold spell

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer else ""
