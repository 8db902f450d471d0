"""Prompt lookup: propose the tokens that followed the last occurrence of the sequence's own suffix."""


def propose_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens: find the latest earlier place where the last n tokens (longest n first) appeared,
    and return what came after it there."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        first = suffix[0]
        # Scan backwards so the most recent match wins (it is the likeliest to continue the same way).
        for start in range(length - n - 1, -1, -1):
            if tokens[start] == first and tokens[start:start + n] == suffix:
                follow = tokens[start + n:start + n + k]
                if follow:
                    return follow
    return []


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, items, _sampler) -> list[tuple[list[int], None]]:
        """Each item's drafts (up to its max_drafts), with no distribution: a deterministic proposal's q is
        one-hot."""
        return [(propose_ngram(item.seq.token_ids, item.max_drafts, self.min_n, self.max_n), None) for item in items]

    def release(self, seq) -> None:
        pass

    def rollback(self, seq, num_valid: int) -> None:
        pass
