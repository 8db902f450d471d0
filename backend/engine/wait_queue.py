"""Sequences waiting to be admitted, taken in turns by client and, within a client, by request.

Each client (who sent it: a user id the request names, else its user agent and address; see
server/client_id.py) has a turn, and within it each of its requests (its group: a completion's list of prompts
is one, an embeddings request with its inputs is one) has a queue of its own. Admission takes one sequence from
each client in turn, that client's next request's, so neither a request with 1,000 prompts nor a client with
many requests can push a later one behind all of theirs: a new client is admitted after at most one sequence of
each client ahead of it. Sequences that were already running (preempted, or forks that found no room) come back
before anyone new, as they did in one queue. A sequence without a client is a client of its own request.
"""

from collections import OrderedDict, deque
from collections.abc import Iterator

from backend.engine.sequence import Sequence


def group_of(seq: Sequence) -> str:
    return seq.group or seq.request_id


def client_of(seq: Sequence) -> str:
    """Whose turn a sequence waits in, and whose share of the slots it counts against."""
    return f"client:{seq.client}" if seq.client else f"request:{group_of(seq)}"


class WaitQueue:
    def __init__(self) -> None:
        self.first: deque[Sequence] = deque()  # back from running: admitted before the turns
        # client -> (request -> its sequences); the next turn first at both levels
        self.turns: OrderedDict[str, OrderedDict[str, deque[Sequence]]] = OrderedDict()

    def add(self, seq: Sequence) -> None:
        """A new sequence, behind its request's others (a new client takes the last turn, a new request the
        last of its client's)."""
        requests = self.turns.setdefault(client_of(seq), OrderedDict())
        requests.setdefault(group_of(seq), deque()).append(seq)

    def add_first(self, seq: Sequence) -> None:
        """A sequence that was running, before every other."""
        self.first.appendleft(seq)

    def peek(self) -> Sequence:
        return self.first[0] if self.first else self._head(next(iter(self.turns.values())))

    def pop(self) -> Sequence:
        """The sequence peek() showed; its client's turn passes to the next client."""
        seq = self.peek()
        self.take(seq)
        return seq

    def next_outside(self, clients: set[str]) -> Sequence | None:
        """The next sequence to admit, passing over the clients named (those holding all the slots they may);
        one that was running comes first whatever its client."""
        if self.first:
            return self.first[0]
        return next((self._head(requests) for client, requests in self.turns.items() if client not in clients), None)

    def resumes(self, seq: Sequence) -> bool:
        """Whether seq was running before (it is admitted before anyone new, whatever its client holds)."""
        return bool(self.first) and self.first[0] is seq

    def take(self, seq: Sequence) -> None:
        """Admit seq, which next_outside() or peek() showed: the first of its client's next request; the turn
        passes to the next request of that client and to the next client."""
        if self.first and self.first[0] is seq:
            self.first.popleft()
            return
        client, group = client_of(seq), group_of(seq)
        requests = self.turns[client]
        requests[group].popleft()
        if requests[group]:
            requests.move_to_end(group)
        else:
            del requests[group]
        if requests:
            self.turns.move_to_end(client)
        else:
            del self.turns[client]

    def remove(self, seq: Sequence) -> bool:
        """Take out a sequence wherever it waits; False when it does not."""
        if seq in self.first:
            self.first.remove(seq)
            return True
        client, group = client_of(seq), group_of(seq)
        requests = self.turns.get(client)
        seqs = requests.get(group) if requests is not None else None
        if seqs is None or seq not in seqs:
            return False
        seqs.remove(seq)
        if not seqs:
            del requests[group]
            if not requests:
                del self.turns[client]
        return True

    @staticmethod
    def _head(requests: OrderedDict[str, deque[Sequence]]) -> Sequence:
        return next(iter(requests.values()))[0]

    def __len__(self) -> int:
        return len(self.first) + sum(len(seqs) for requests in self.turns.values() for seqs in requests.values())

    def __bool__(self) -> bool:
        return bool(self.first or self.turns)

    def __iter__(self) -> Iterator[Sequence]:
        yield from self.first
        for requests in self.turns.values():
            for seqs in requests.values():
                yield from seqs
