"""Turns generated token ids into text one token at a time, as streaming needs."""


class IncrementalDetokenizer:
    """Decodes a sliding window so that multi-byte characters split across tokens come out whole.

    The window starts a few prompt tokens back: tokenizers that drop a leading space when a word
    begins a text would otherwise lose the space of the first generated word.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.window = list(prompt_token_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.window)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (may be empty while a character is split)."""
        self.window.append(token_id)
        prefix = self._decode(self.window[self.prefix_offset:self.read_offset])
        full = self._decode(self.window[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.window)
            if self.prefix_offset > 64:  # keep the window short; offsets move with it
                drop = self.prefix_offset
                self.window = self.window[drop:]
                self.prefix_offset, self.read_offset = 0, self.read_offset - drop
            self.text += delta
            return delta
        return ""
