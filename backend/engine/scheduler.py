"""Continuous batching with chunked prefill and preemption by recomputation.

Every step has a budget of max_num_batched_tokens. Running sequences go first, oldest first,
each taking one token (decode) or the next chunk of its prompt; waiting sequences then join
in arrival order while budget, sequence slots and KV blocks last. When a running sequence
needs a block and none is free, the newest running sequence is preempted: its blocks are
freed and it goes back to the front of the queue, to be recomputed (mostly from the prefix
cache) later.
"""

from collections import deque
from dataclasses import dataclass

from backend.engine.block_manager import BlockManager
from backend.engine.sequence import Sequence, Status


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed for it this step, its draft tokens included
    num_draft: int = 0  # speculative tokens appended after its last known token, to verify

    @property
    def samples(self) -> bool:
        """Whether this step computes the sequence's last known token, so a new one is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens - self.num_draft == self.seq.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.on_release: list = []  # callbacks(seq) when a sequence's blocks are freed (draft caches follow)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _release(self, seq: Sequence) -> None:
        self.block_manager.free_sequence(seq)
        seq.draft_tokens, seq.draft_probs = [], None
        for callback in self.on_release:
            callback(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = seq.num_tokens - seq.num_computed_tokens
            drafts = len(seq.draft_tokens)
            if drafts and (n + drafts > budget or not self.block_manager.append_slots(seq, n + drafts)):
                seq.draft_tokens, seq.draft_probs, drafts = [], None, 0  # verify nothing rather than evict
            n = min(n + drafts, budget)
            while not self.block_manager.append_slots(seq, n):
                victim = self.running.pop()  # the newest; always at or after position i
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                batch.append(ScheduledSeq(seq, n, drafts))
                budget -= n
                i += 1
        for seq in self.running[i:]:  # not scheduled this step: their drafts are stale by the next
            seq.draft_tokens, seq.draft_probs = [], None
        if preempted:
            return batch  # no admissions in a step that had to evict
        # A sequence with pending forks (a request's other n - 1) holds their slots too, so that they can
        # join the batch with it once its prompt is prefilled.
        slots = len(self.running) + sum(len(s.forks) for s in self.running)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if slots + 1 + len(seq.forks) > self.max_num_seqs:
                break
            hit_ids, hit_hashes = self.block_manager.find_cached_prefix(seq)
            n = min(seq.num_tokens - len(hit_ids) * self.block_manager.block_size, budget)
            if not self.block_manager.allocate(seq, hit_ids, hit_hashes, n):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            slots += 1 + len(seq.forks)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        return batch

    def fork(self, parent: Sequence, child: Sequence, copy_block) -> bool:
        """Start child from parent's prefilled prompt: it shares the full blocks and gets a copy of the partial
        last one (copy_block(src, dst) copies its KV), and runs from now on. Without a free block or slot it
        queues first in line instead, to find the prompt in the prefix cache."""
        if len(self.running) < self.max_num_seqs:
            copy = self.block_manager.fork(parent, child)
            if copy is not False:
                if copy is not None:
                    copy_block(*copy)
                child.status = Status.RUNNING
                self.running.append(child)
                return True
        self.waiting.appendleft(child)
        return False

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and release its blocks."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED
