"""The paged KV cache's bookkeeping: blocks, reference counts and the prefix cache.

A full block is identified by a hash chained over every token before it (its parent's hash
and its own tokens), so equal hashes mean equal prefixes; the block's tokens are kept too and
compared on a hit, so a hash collision can never serve wrong KV. Freed blocks keep their
contents and hash; they are reused least recently freed first, and until then a later request
with the same prefix can pick them up again.

With a disk cache (engine/disk_prefix_cache.py) the hashes outlive the process: a freed sequence's hashed blocks
are handed to it to be written, and a lookup that misses in memory goes on on disk, loading the blocks it finds
there into free blocks that then serve the hit as freed cached blocks do.
"""

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backend.engine.cache_groups import blocks_for
from backend.engine.rope_switch import root_hash
from backend.engine.sequence import Sequence
from backend.engine.state_pool import SNAPSHOT_SLOTS, StatePool
from backend.engine.state_snapshots import StateCopies, StateSnapshots
from backend.engine.window_blocks import WindowBlocks

if TYPE_CHECKING:
    from backend.engine.cache_groups import SlidingGroup
    from backend.engine.disk_prefix_cache import DiskPrefixCache


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


ROOT_HASH = 0  # the parent of a first block: a constant, as hash(None) differs between processes before 3.12


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """Stable across processes (hashes of ints and tuples of ints are), so the disk cache can key on it."""
    return hash((ROOT_HASH if parent is None else parent, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 disk: "DiskPrefixCache | None" = None, state_slots: int = 0, sliding: "SlidingGroup | None" = None):
        self.block_size = block_size
        # The sliding-window layers' blocks, released once out of every window (engine/window_blocks.py); these
        # blocks are the full group's
        self.window = WindowBlocks(sliding.num_blocks, block_size, sliding.window) if sliding else None
        # A hybrid model's linear-attention states, a slot a running sequence (engine/state_pool.py), and with
        # prefix caching the snapshots its hits resume from, in the rows after them (engine/state_snapshots.py)
        self.states = StatePool(state_slots) if state_slots else None
        self.snapshots = StateSnapshots(state_slots, SNAPSHOT_SLOTS) if state_slots and enable_prefix_caching else None
        self.enable_prefix_caching = enable_prefix_caching
        # A disk entry would need each group's blocks: a model with a sliding group writes none
        self.disk = disk if enable_prefix_caching and self.window is None else None
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front is evicted first
        self.cached: dict[int, int] = {}  # hash -> block id
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / len(self.blocks)

    def _take_free_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def find_cached_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Block ids and hashes of the longest cached run of the sequence's leading full blocks.

        At least one token is always left to compute: its logits are needed to sample from.
        """
        if not self.enable_prefix_caching:
            return [], []
        ids, hashes, parent = [], [], root_hash(seq)  # short and scaled RoPE's KV differ: never each other's
        size = self.block_size
        limit = (seq.num_tokens - 1) // size
        for i in range(limit):
            tokens = tuple(seq.token_ids[i * size:(i + 1) * size])
            h = chain_hash(parent, tokens)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            ids.append(block_id)
            hashes.append(h)
            parent = h
        if self.disk is not None and len(ids) < limit:
            self._load_from_disk(seq, ids, hashes, limit)
        if self.window is not None:  # as far as the sliding group holds the window before the hit's end
            usable = self.window.usable_hit(seq, hashes)
            ids, hashes = ids[:usable], hashes[:usable]
        if self.snapshots is not None:  # as far as a snapshot holds the linear layers' states at the hit's end
            usable = self.snapshots.longest(hashes)
            ids, hashes = ids[:usable], hashes[:usable]
        return ids, hashes

    def _load_from_disk(self, seq: Sequence, ids: list[int], hashes: list[int], limit: int) -> None:
        """Extend the hit (ids, hashes) with the blocks after it that the disk cache holds: each is loaded into a
        free block (never one of the hit's) that joins the prefix cache as a freed cached block, most recently
        used; allocate() then revives it like any other."""
        reviving = [b for b in ids if self.blocks[b].ref_count == 0]
        for block_id in reviving:  # about to be used: out of reach of the blocks taken below
            self.free.move_to_end(block_id)
        room = len(self.free) - len(reviving)
        end, parent = min(limit, len(ids) + room), hashes[-1] if hashes else root_hash(seq)
        for h, tokens, data in self.disk.load(seq.token_ids, len(ids), end, parent, self.block_size):
            block_id = self._take_free_block()
            self.disk.write_block(block_id, data)
            block = self.blocks[block_id]
            block.ref_count, block.hash, block.token_ids = 0, h, tokens
            self.cached[h] = block_id
            self.free[block_id] = None
            ids.append(block_id)
            hashes.append(h)

    def allocate(self, seq: Sequence, hit_ids: list[int], hit_hashes: list[int], num_new_tokens: int) -> bool:
        """Give a sequence entering the running set its cached prefix plus room for num_new_tokens more."""
        num_hit_tokens = len(hit_ids) * self.block_size
        needed = blocks_for(num_hit_tokens + num_new_tokens, self.block_size) - len(hit_ids)
        revived = sum(1 for b in hit_ids if self.blocks[b].ref_count == 0)  # these leave the free list
        if needed + revived > len(self.free) or (self.states is not None and not self.states.num_free):
            return False
        if self.window is not None and not self.window.allocate(seq, hit_hashes, num_hit_tokens + num_new_tokens):
            return False
        if self.states is not None:
            seq.state_slot = self.states.take()
        for block_id in hit_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
        seq.block_table = list(hit_ids) + [self._take_free_block() for _ in range(needed)]
        seq.block_hashes = list(hit_hashes)
        seq.num_computed_tokens = num_hit_tokens
        if seq.num_cached_tokens is None:  # count the prompt's lookup once, not again after a preemption
            seq.num_cached_tokens = num_hit_tokens
            self.prefix_queries += seq.num_prompt_tokens
            self.prefix_hits += num_hit_tokens
        return True

    def plan_states(self, seq: Sequence, n: int, hit_hashes: list[int] | None = None) -> tuple[int, StateCopies | None]:
        """A hybrid model's chunk of n tokens after seq.num_computed_tokens, cut to end at the sequence's snapshot
        boundary where it would pass it, and its state copies: the snapshot an admission's hit (hit_hashes)
        resumes from, and the slot reserved for the states at the boundary where the chunk ends there."""
        if self.snapshots is None or seq.pooling:
            return n, None
        start, end = seq.num_computed_tokens, (seq.num_tokens - 1) // self.block_size * self.block_size
        if start < end < start + n:
            n = end - start
        resume = self.snapshots.resume(hit_hashes[-1]) if hit_hashes else None
        snapshot = self.snapshots.reserve(seq.seq_id, end // self.block_size) if start < end == start + n else None
        return n, None if resume is None and snapshot is None else StateCopies(resume, snapshot)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make sure the sequence's blocks cover num_new_tokens more tokens; False if the cache is full."""
        needed = blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_table)
        if needed > len(self.free):
            return False
        if self.window is not None and not self.window.append(seq, seq.num_computed_tokens + num_new_tokens):
            return False
        seq.block_table.extend(self._take_free_block() for _ in range(needed))
        return True

    def fork(self, parent: Sequence, child: Sequence, num_computed: int) -> tuple[int, int] | None | bool:
        """Give child the parent's first num_computed tokens of KV: full blocks shared (never written again),
        the partial last block, which both will append to, as a fresh copy. Returns (source, copy) block ids
        when a copy is needed, None when none is, False when no block is free for it (nothing changed)."""
        if self.states is not None:  # the parent's state is not copied: a hybrid model's siblings prefill apart
            raise RuntimeError("a hybrid model's sequences do not fork; each prefills its own prompt")
        full, partial = divmod(num_computed, self.block_size)
        if partial and (not self.free or (self.window is not None and not self.window.free)):
            return False
        window_copy = self.window.fork(parent, child, full, partial > 0) if self.window is not None else None
        for block_id in parent.block_table[:full]:
            self.blocks[block_id].ref_count += 1
        child.block_table = parent.block_table[:full]
        child.block_hashes = list(parent.block_hashes[:full])
        child.num_computed_tokens = num_computed
        child.num_cached_tokens = parent.num_cached_tokens
        child.rope_offset = parent.rope_offset
        if not partial:
            return None
        copy = self._take_free_block()
        child.block_table.append(copy)
        return (parent.block_table[full], copy, *(window_copy or ()))

    def hash_full_blocks(self, seq: Sequence) -> None:
        """Hash the sequence's newly completed full blocks into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // size):
            tokens = tuple(seq.token_ids[i * size:(i + 1) * size])
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else root_hash(seq), tokens)
            seq.block_hashes.append(h)
            if self.window is not None:
                self.window.hash_block(seq, i, h, tokens)
            block = self.blocks[seq.block_table[i]]
            if h not in self.cached:
                block.hash, block.token_ids = h, tokens
                self.cached[h] = block.block_id
        if self.snapshots is not None:
            self.snapshots.settle(seq.seq_id, seq.block_hashes)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release the blocks past the first num_tokens tokens (slots of rejected draft tokens)."""
        keep = blocks_for(num_tokens, self.block_size)
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                self.free.move_to_end(block_id, last=False)
        del seq.block_table[keep:]
        if self.window is not None:
            self.window.trim(seq, keep)

    def take_blocks(self, n: int) -> list[int] | None:
        """n free blocks for a pass outside the scheduler (embeddings); None when fewer are free. They never
        enter the prefix cache."""
        if n > len(self.free):
            return None
        return [self._take_free_block() for _ in range(n)]

    def release_blocks(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self.blocks[block_id].ref_count = 0
            self.free[block_id] = None
            self.free.move_to_end(block_id, last=False)  # nothing to reuse in them: taken first

    def free_sequence(self, seq: Sequence) -> None:
        if self.disk is not None and seq.block_hashes:  # its computed full blocks, kept past this process
            self.disk.offer(seq.token_ids, seq.block_hashes, seq.block_table, self.block_size, root_hash(seq))
        # Tail blocks are released first, so a prefix's leading blocks are the last to be evicted.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.hash is None:  # nothing anyone can reuse: evict it before cached blocks
                    self.free.move_to_end(block_id, last=False)
        seq.block_table = []
        if self.window is not None:
            self.window.free_sequence(seq)
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        if self.states is not None and seq.state_slot is not None:
            self.states.give_back(seq.state_slot)
            seq.state_slot = None
        if self.snapshots is not None:
            self.snapshots.drop(seq.seq_id)

    def forget_contents(self) -> None:
        """The cache's tensors were freed (the engine slept with every block free): no block holds a prefix now.
        The disk cache's entries stay: they are read into blocks again on a hit."""
        for block in self.blocks:
            block.hash, block.token_ids = None, ()
        self.cached.clear()
        if self.window is not None:
            self.window.forget_contents()
        if self.snapshots is not None:  # the states were freed with the cache
            self.snapshots.clear()
