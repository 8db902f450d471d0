"""The sliding-window layers' own pool of KV blocks (DESIGN.md, "Layer kinds and cache groups").

A sliding layer's query at position p reads positions p - window + 1 .. p only, so once a sequence has computed
its first n tokens, no later query of it reads a block that ends before n - window + 1. Those blocks go back to
this pool while the sequence runs. Each sequence has a window table beside its block table: the same length, the
same token-to-block arithmetic, with -1 where a block was released (or never needed: a prefix hit's blocks before
its last window). The kernels never read those entries, as they read a sliding layer only within its window.

Released blocks keep their chain hash (the full group's, engine/block_manager.py) until they are reused, least
recently released first; a prefix hit is usable as far as this pool still holds the blocks of the window before
its end (usable_hit), so hits on recently run prompts still serve the whole prefix.
"""

from collections import OrderedDict

from backend.engine.cache_groups import blocks_for
from backend.engine.sequence import Sequence


class WindowBlocks:
    def __init__(self, num_blocks: int, block_size: int, window: int):
        self.block_size, self.window = block_size, window
        self.refs = [0] * num_blocks
        self.hashes: list[int | None] = [None] * num_blocks
        self.tokens: list[tuple[int, ...]] = [()] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front is reused first
        self.cached: dict[int, int] = {}  # hash -> block id

    @property
    def num_blocks(self) -> int:
        return len(self.refs)

    def first_read(self, position: int) -> int:
        """The first block that a query at this position, or at any later one, reads."""
        return max(0, position - self.window + 1) // self.block_size

    def _take(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        h = self.hashes[block_id]
        if h is not None:
            if self.cached.get(h) == block_id:
                del self.cached[h]
            self.hashes[block_id], self.tokens[block_id] = None, ()
        self.refs[block_id] = 1
        return block_id

    def _drop(self, block_id: int, reuse_first: bool = False) -> None:
        self.refs[block_id] -= 1
        if self.refs[block_id] == 0:
            self.free[block_id] = None
            if reuse_first or self.hashes[block_id] is None:  # nothing anyone can pick up again
                self.free.move_to_end(block_id, last=False)

    def _holds(self, seq: Sequence, i: int, h: int) -> bool:
        block_id = self.cached.get(h)
        size = self.block_size
        return block_id is not None and self.tokens[block_id] == tuple(
            seq.token_ids[i * size : (i + 1) * size]
        )

    def usable_hit(self, seq: Sequence, hashes: list[int]) -> int:
        """How many of a prefix hit's leading blocks (hashes, the full group's) this pool can serve: the most k
        for which it still holds every block that the window before token k * block_size covers."""
        k = len(hashes)
        while k:
            missing = [
                i
                for i in range(self.first_read(k * self.block_size), k)
                if not self._holds(seq, i, hashes[i])
            ]
            if not missing:
                return k
            k = missing[-1]  # any hit past it would need that block too
        return 0

    def allocate(self, seq: Sequence, hit_hashes: list[int], num_tokens: int) -> bool:
        """The sequence's window table: the hit's blocks that its next queries read (hit_hashes, usable_hit's
        length), fresh blocks up to num_tokens; False (nothing changed) when the pool lacks room."""
        k = len(hit_hashes)
        first = self.first_read(k * self.block_size)
        if any(h not in self.cached for h in hit_hashes[first:]):
            return False  # reused since the lookup: the scheduler looks the prompt up again next step
        hit = [self.cached[h] for h in hit_hashes[first:]]
        fresh = blocks_for(num_tokens, self.block_size) - k
        if fresh + sum(1 for b in hit if self.refs[b] == 0) > len(self.free):
            return False
        for block_id in hit:
            if self.refs[block_id] == 0:
                del self.free[block_id]
            self.refs[block_id] += 1
        seq.window_table = [-1] * first + hit + [self._take() for _ in range(fresh)]
        return True

    def release_passed(self, seq: Sequence) -> None:
        """Give back the blocks no query from seq.num_computed_tokens on reads. Held entries are one run at the
        table's end (released in order), so the walk stops at the first entry already given back."""
        table = seq.window_table
        i = min(self.first_read(seq.num_computed_tokens), len(table)) - 1
        while i >= 0 and table[i] >= 0:
            self._drop(table[i])
            table[i] = -1
            i -= 1

    def append(self, seq: Sequence, num_tokens: int) -> bool:
        """Release what the window has passed, then cover num_tokens; False when the pool lacks room."""
        self.release_passed(seq)
        needed = blocks_for(num_tokens, self.block_size) - len(seq.window_table)
        if needed > len(self.free):
            return False
        seq.window_table.extend(self._take() for _ in range(needed))
        return True

    def fork(self, parent: Sequence, child: Sequence, full: int, partial: bool) -> tuple[int, int] | None:
        """The child's window table: the parent's first `full` entries shared, its partial block copied (the
        returned (source, copy)); the caller checked that a block is free for it."""
        shared = parent.window_table[:full]
        for block_id in shared:
            if block_id >= 0:
                self.refs[block_id] += 1
        child.window_table = shared
        if not partial:
            return None
        copy = self._take()
        child.window_table.append(copy)
        return parent.window_table[full], copy

    def hash_block(self, seq: Sequence, i: int, h: int, tokens: tuple[int, ...]) -> None:
        """Block i of the sequence is full and hashed h in the full group: the window's block joins the cache."""
        block_id = seq.window_table[i]
        if block_id >= 0 and h not in self.cached:
            self.hashes[block_id], self.tokens[block_id] = h, tokens
            self.cached[h] = block_id

    def trim(self, seq: Sequence, keep: int) -> None:
        """Release the entries past the first `keep` blocks (rejected drafts' slots)."""
        for block_id in reversed(seq.window_table[keep:]):
            if block_id >= 0:
                self._drop(block_id, reuse_first=True)
        del seq.window_table[keep:]

    def free_sequence(self, seq: Sequence) -> None:
        for block_id in seq.window_table:  # in order: the last window's blocks, a whole-prompt hit's, go last
            if block_id >= 0:
                self._drop(block_id)
        seq.window_table = []

    def forget_contents(self) -> None:
        """The cache's tensors were freed: no block holds a prefix now."""
        self.hashes = [None] * self.num_blocks
        self.tokens = [()] * self.num_blocks
        self.cached.clear()

    def held(self) -> int:
        return self.num_blocks - len(self.free)
