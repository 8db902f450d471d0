"""One generated continuation of a request (a request with n > 1 has n sequences).

Made by admission.request_sequences (embedding.embedding_sequences for embedding inputs); from then on written by
Scheduler.postprocess and the scheduler's own steps (status, forks, finishing), the block manager for what goes
with its blocks (block_table, block_hashes, state_slot, and the computed tokens a prefix hit or a freeing sets).
Everything else reads it."""

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
    matcher: object | None = None  # structured output: which tokens may come next (xgrammar)
    group: str | None = None  # whose turn it is at admission (the client's request; None: request_id)
    client: str | None = None  # who sent it (None: a client of its own request); its turns and slot share
    # An embedding input: its prompt is computed and its hidden rows pooled, nothing is sampled (engine/embedding.py)
    pooling: bool = False
    pooled: torch.Tensor | None = None  # the sum of its hidden rows computed so far
    embedding: torch.Tensor | None = None  # once its last chunk is computed: the normalised mean
    # n > 1: the siblings that take this sequence's KV once its prompt is prefilled (prefilled once for all)
    forks: list["Sequence"] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    block_table: list[int] = field(default_factory=list)
    # the sliding-window layers' blocks, by the same index as block_table; -1 where no window reads any more
    # (engine/window_blocks.py); empty without a sliding group
    window_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chain hashes of the leading full blocks
    # its row 0 in the model's rotary table: 0 (the scaled rows), or the short rows' start where RoPE switches by
    # length and it is within the switch length (engine/rope_switch.py)
    rope_offset: int = 0
    state_slot: int | None = None  # a hybrid model's: its linear-attention state's slot (engine/state_pool.py)
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None
    error: str | None = None  # why processing this sequence failed (finish_reason "error")
    error_param: str | None = None  # the request's setting at fault, when its own input made it fail (a 400)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    # the request's prompt logprobs, on its first sequence (engine/prompt_logprobs.py): one entry per prompt token
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

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
