"""A structured-output grammar that starts after a reasoning model's think block.

A `<think>` model asked for JSON (response_format, a forced tool call) reasons first and answers after
`</think>`: the grammar constrains the answer alone. While the block is open every token may come; before the
output has begun, the model may open a block (`<think>`) or start the answer, which the grammar then holds from
its first token. Both markers are one token each (the server checks that before asking for this).
"""

from dataclasses import dataclass


@dataclass
class ThinkFirstMatcher:
    """xgrammar's matcher interface (accept_token, is_terminated, fill_next_token_bitmask) over a grammar that
    holds after the think block."""

    grammar: object  # the answer's matcher
    open_id: int
    close_id: int
    state: str = "start"  # start: nothing written yet; thinking: inside the block; answer: the grammar holds

    def accept_token(self, token: int) -> bool:
        if self.state == "thinking":
            if token == self.close_id:
                self.state = "answer"
            return True
        if self.state == "start" and token == self.open_id:
            self.state = "thinking"
            return True
        self.state = "answer"
        return self.grammar.accept_token(token)

    def is_terminated(self) -> bool:
        return self.state == "answer" and self.grammar.is_terminated()

    def fill_next_token_bitmask(self, bitmask, row: int) -> None:
        """Row `row` of an all-allowed bitmask (as xgrammar allocates it) set to what may come next."""
        if self.state == "thinking":
            return
        self.grammar.fill_next_token_bitmask(bitmask, row)
        if self.state == "start":  # the block may still open
            word, bit = divmod(self.open_id, 32)
            bitmask[row, word] |= (1 << bit) if bit < 31 else -(1 << 31)  # int32 words: bit 31 is the sign


def think_first(grammar, open_id: int, close_id: int, opened: bool) -> ThinkFirstMatcher:
    """The grammar held after the think block; opened: the prompt has opened the block already."""
    return ThinkFirstMatcher(grammar, open_id, close_id, "thinking" if opened else "start")
