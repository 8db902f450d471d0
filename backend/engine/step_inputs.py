"""A step's rows, laid out once from its plan (plan → rows): the token ids, positions and cache slots the
forward pass reads, which items attend as decode rows, and which rows are whose. Eager steps turn it into
tensors and attention metadata, captured CUDA graphs copy it into their static inputs (engine/model_runner.py),
and the sample stage reads each item's rows of the logits from it. Nothing here writes the plan."""

from collections.abc import Callable
from dataclasses import dataclass, field

from backend.engine.cache_groups import window_slots
from backend.engine.scheduler import ScheduledSeq, StepPlan


@dataclass(frozen=True)
class StepInputs:
    input_ids: list[int]
    positions: list[int]
    rope_rows: list[int]  # each row's row of the model's rotary table: its position plus its sequence's rope_offset
    slots: list[int]  # each row's place in the paged KV cache
    tables: list[list[int]]  # each decode row's block table (its sequence's own list)
    decode: list[int]  # plan indexes whose rows attend as decode rows: first in the step
    prefill: list[int]  # plan indexes of prompt chunks (and verification runs that attend as one), after them
    hidden_rows: list[slice]  # per plan item: its rows of the step's hidden states
    logit_rows: list[slice | None]  # per plan item: its rows of the step's logits; None: it samples nothing
    sample_rows: list[int]  # the hidden rows the logits are computed from, in plan order
    # the sliding group's (engine/cache_groups.py), laid out as slots and tables are; empty without one
    window_slots: list[int] = field(default_factory=list)
    window_tables: list[list[int]] = field(default_factory=list)

    @property
    def num_decode(self) -> int:
        """Rows that attend as decode rows."""
        return self.hidden_rows[self.decode[-1]].stop if self.decode else 0


def lay_out(plan: StepPlan, block_size: int, attends_as_decode: Callable[[ScheduledSeq], bool],
            windowed: bool = False) -> StepInputs:
    """Decode rows first (in plan order), then the prompt chunks. An item's rows are its tokens from the first
    one not yet computed, its drafts after them; a sampling item's logit rows are its last row, or its last
    known token's row and its drafts' when it verifies them. windowed: the sliding group's slots and tables too."""
    decode = [i for i, item in enumerate(plan) if attends_as_decode(item)]
    prefill = [i for i, item in enumerate(plan) if not attends_as_decode(item)]
    input_ids: list[int] = []
    positions: list[int] = []
    rope_rows: list[int] = []
    slots: list[int] = []
    wslots: list[int] = []
    hidden_rows: list[slice] = [slice(0, 0)] * len(plan)
    for i in decode + prefill:
        item = plan[i]
        seq, start = item.seq, item.seq.num_computed_tokens
        hidden_rows[i] = slice(len(input_ids), len(input_ids) + item.num_scheduled_tokens)
        input_ids.extend((seq.token_ids[start:] + item.draft_tokens)[:item.num_scheduled_tokens])
        positions.extend(range(start, start + item.num_scheduled_tokens))
        rope_rows.extend(range(start + seq.rope_offset, start + seq.rope_offset + item.num_scheduled_tokens))
        slots.extend(seq.block_table[p // block_size] * block_size + p % block_size
                     for p in range(start, start + item.num_scheduled_tokens))
        if windowed:
            wslots.extend(window_slots(seq, start, item.num_scheduled_tokens, block_size))
    logit_rows: list[slice | None] = []
    sample_rows: list[int] = []
    for item, rows in zip(plan, hidden_rows):
        if not item.samples:
            logit_rows.append(None)
            continue
        logit_rows.append(slice(len(sample_rows), len(sample_rows) + item.num_draft + 1))
        sample_rows.extend(range(rows.stop - 1 - item.num_draft, rows.stop))
    tables = [plan[i].seq.block_table for i in decode for _ in range(plan[i].num_scheduled_tokens)]
    wtables = [plan[i].seq.window_table for i in decode for _ in range(plan[i].num_scheduled_tokens)] if windowed else []
    return StepInputs(input_ids, positions, rope_rows, slots, tables, decode, prefill, hidden_rows, logit_rows,
                      sample_rows, wslots, wtables)
