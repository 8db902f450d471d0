"""Sequences waiting to be admitted, taken in turns by request.

Each client request (its group: a completion's list of prompts is one, an embeddings request with its
inputs is one) has a queue of its own, and admission takes one sequence from each request in turn, so a
request with 1,000 prompts cannot push a request that came after it behind all of them: the later one is
admitted after at most one sequence of each request ahead of it. Sequences that were already running
(preempted, or forks that found no room) come back before anyone new, as they did in one queue.
"""

from collections import OrderedDict, deque
from collections.abc import Iterator

from backend.engine.sequence import Sequence


def group_of(seq: Sequence) -> str:
    return seq.group or seq.request_id


class WaitQueue:
    def __init__(self) -> None:
        self.first: deque[Sequence] = deque()  # back from running: admitted before the turns
        self.turns: OrderedDict[str, deque[Sequence]] = OrderedDict()  # group -> its sequences; the next turn first

    def add(self, seq: Sequence) -> None:
        """A new sequence, behind its request's others (a new request takes the last turn)."""
        self.turns.setdefault(group_of(seq), deque()).append(seq)

    def add_first(self, seq: Sequence) -> None:
        """A sequence that was running, before every other."""
        self.first.appendleft(seq)

    def peek(self) -> Sequence:
        return self.first[0] if self.first else next(iter(self.turns.values()))[0]

    def pop(self) -> Sequence:
        """The sequence peek() showed; its request's turn passes to the next request."""
        seq = self.peek()
        self.take(seq)
        return seq

    def next_outside(self, groups: set[str]) -> Sequence | None:
        """The next sequence to admit, passing over requests in groups (those holding all the slots they may);
        one that was running comes first whatever its request."""
        if self.first:
            return self.first[0]
        return next((seqs[0] for group, seqs in self.turns.items() if group not in groups), None)

    def resumes(self, seq: Sequence) -> bool:
        """Whether seq was running before (it is admitted before anyone new, whatever its request holds)."""
        return bool(self.first) and self.first[0] is seq

    def take(self, seq: Sequence) -> None:
        """Admit seq, which next_outside() or peek() showed: the first of its request's queue; that request's
        turn passes to the next."""
        if self.first and self.first[0] is seq:
            self.first.popleft()
            return
        group = group_of(seq)
        seqs = self.turns[group]
        seqs.popleft()
        if seqs:
            self.turns.move_to_end(group)
        else:
            del self.turns[group]

    def remove(self, seq: Sequence) -> bool:
        """Take out a sequence wherever it waits; False when it does not."""
        if seq in self.first:
            self.first.remove(seq)
            return True
        seqs = self.turns.get(group_of(seq))
        if seqs is None or seq not in seqs:
            return False
        seqs.remove(seq)
        if not seqs:
            del self.turns[group_of(seq)]
        return True

    def __len__(self) -> int:
        return len(self.first) + sum(len(seqs) for seqs in self.turns.values())

    def __bool__(self) -> bool:
        return bool(self.first or self.turns)

    def __iter__(self) -> Iterator[Sequence]:
        yield from self.first
        for seqs in self.turns.values():
            yield from seqs
