"""RoPE that switches by a sequence's length, so that scaling for a longer context leaves short requests exact.

Where the model runs under RoPE scaling its own config does not apply at every length (YaRN or linear scaling we
add past the trained context, LongRoPE's short and long factors: context_length.fit_context), the model's rotary
table holds the scaled rows of every position, then the short-sequence rows of the positions before the switch
(rotary.model_cos_sin). A sequence reads its rows at `seq.rope_offset`: 0 (scaled) or the start of the short
rows. It is admitted short while its tokens stay within the switch length; the step that would compute a position
past it preempts it instead, and it is admitted again scaled and recomputed whole, once, as transformers computes
the longer sequence with the scaled frequencies at every position. The two kinds' KV differ, so their prefix-cache
hashes start from different roots and never match each other (in memory and on disk).
"""

from dataclasses import dataclass

import torch

from backend.engine.sequence import Sequence

SHORT_ROOT = 1  # the parent hash of a short sequence's first block (scaled ones: block_manager.ROOT_HASH, 0)


@dataclass(frozen=True)
class RopeSwitch:
    length: int  # sequences of at most this many tokens rotate by the short rows
    short_row: int  # where the short rows start in the model's table (the scaled rows' count)

    def admit(self, seq: Sequence) -> None:
        seq.rope_offset = self.short_row if seq.num_tokens <= self.length else 0

    def passes(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether computing num_new_tokens more would take a short sequence past the switch length."""
        return seq.rope_offset != 0 and seq.num_computed_tokens + num_new_tokens > self.length


def of(model: torch.nn.Module) -> RopeSwitch | None:
    """The loaded model's switch (its table's layout), None where its RoPE does not switch."""
    length = model.config.rope_switch_length
    return RopeSwitch(length, model.cos_sin.shape[0] - length) if length else None


def admit(switch: RopeSwitch | None, seq: Sequence) -> None:
    """At admission, before the prefix-cache lookup: which rows the sequence reads, by its length now."""
    if switch is not None:
        switch.admit(seq)


def passes(switch: RopeSwitch | None, seq: Sequence, num_new_tokens: int) -> bool:
    return switch is not None and switch.passes(seq, num_new_tokens)


def root_hash(seq: Sequence) -> int | None:
    """The parent hash of the sequence's first block: None (block_manager.ROOT_HASH) for scaled rows."""
    return SHORT_ROOT if seq.rope_offset else None
