"""Snapshots of a hybrid model's linear-attention states on the block grid, for its prefix hits (the design
follows vLLM's hybrid cache manager with prefix caching on).

A linear layer's state summarises every token before it, so a cached prefix is resumed only from a copy of the
states taken at exactly its end. When a prompt's prefill reaches the boundary of its last full block before its
last token (the deepest a repeat of it, or a longer prompt that starts with it, can hit), the scheduler ends the
chunk there and the model runner copies the states after that chunk into a snapshot slot, keyed by the chain hash
of the boundary's block (engine/block_manager.py). A later prompt whose cached full-attention blocks reach a
boundary with a snapshot takes it: its hit is cut back to the longest such boundary, the snapshot is copied into
its own slot, and only the rest is prefilled. A snapshot whose blocks were evicted is simply never hit.

The slots are rows of the state pool's tensors after the running sequences' (state_pool.SNAPSHOT_SLOTS), reused
least recently used first. A slot is reserved when the chunk is planned and keyed after the step, once the block
is hashed; every copy lies within one step (resume before the forward, snapshot after), so a snapshot evicted by
a reservation in the step that resumes from it is read before it is overwritten.
"""

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StateCopies:
    """A prompt chunk's state copies in its step (model runner: state_pool.resume_states, snapshot_states)."""

    resume_from: int | None = None  # the snapshot slot the sequence's slot is copied from before the forward
    snapshot: int | None = None  # the snapshot slot the sequence's states are copied to after it


class StateSnapshots:
    def __init__(self, first_slot: int, num_slots: int):
        self.num_slots = num_slots
        self.free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))  # popped from the end
        self.held: OrderedDict[int, int] = OrderedDict()  # boundary block's hash -> slot; least recent first
        self.pending: dict[int, tuple[int, int]] = {}  # seq_id -> (slot, blocks before its boundary)
        self.resumes = 0  # prompts (admissions and recomputations) that started from a snapshot

    def longest(self, hashes: list[int]) -> int:
        """How many of the leading blocks `hashes` names end at a held snapshot (the most; 0: none)."""
        return next((k for k in range(len(hashes), 0, -1) if hashes[k - 1] in self.held), 0)

    def resume(self, block_hash: int) -> int:
        """The slot of the snapshot after the block block_hash, now the most recently used."""
        self.held.move_to_end(block_hash)
        self.resumes += 1
        return self.held[block_hash]

    def reserve(self, seq_id: int, blocks: int) -> int | None:
        """A slot for the sequence's states after its first `blocks` blocks, copied this step: a free one, else the
        least recently used snapshot's; None while every slot waits for its copy."""
        self.drop(seq_id)
        if self.free:
            slot = self.free.pop()
        elif self.held:
            slot = self.held.popitem(last=False)[1]
        else:
            return None
        self.pending[seq_id] = (slot, blocks)
        return slot

    def settle(self, seq_id: int, hashes: list[int]) -> None:
        """Key the sequence's copied snapshot by its boundary block's hash, once that block is hashed; a snapshot
        of the same prefix taken before gives its slot back."""
        slot, blocks = self.pending.get(seq_id, (None, 0))
        if slot is None or len(hashes) < blocks:
            return
        del self.pending[seq_id]
        replaced = self.held.pop(hashes[blocks - 1], None)
        if replaced is not None:
            self.free.append(replaced)
        self.held[hashes[blocks - 1]] = slot

    def drop(self, seq_id: int) -> None:
        """A reservation that will not be copied (the sequence was preempted or finished first)."""
        slot, _ = self.pending.pop(seq_id, (None, 0))
        if slot is not None:
            self.free.append(slot)

    def clear(self) -> None:
        """The state tensors were freed: no snapshot holds anything now."""
        self.free += list(self.held.values()) + [slot for slot, _ in self.pending.values()]
        self.held.clear()
        self.pending.clear()
