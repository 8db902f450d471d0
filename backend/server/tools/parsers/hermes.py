"""Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text around them
(Hermes 2/3, Qwen 2.5/3, and the prompt we write for templates that know no tools)."""

from backend.server.tools.parsers.base import ToolParser
from backend.server.tools.scanner import CallScanner


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    opening = OPEN

    def __init__(self, strip: tuple[str, ...] = ()):
        super().__init__(strip)
        self.scanner: CallScanner | None = None
        self.closing = False

    def _advance(self, events: list) -> None:
        while True:
            if self.closing:
                stripped = self.pending.lstrip()
                if stripped.startswith(self.CLOSE):
                    self.pending = stripped[len(self.CLOSE) :]
                elif self.CLOSE.startswith(stripped):
                    return  # the closing tag may be arriving
                self.closing = False
            if self.scanner is None:
                if self._through((self.OPEN,), events) is None:
                    return
                self.scanner = CallScanner(first_index=self.num_calls)
            scanner = self.scanner
            if not self._scan(scanner, events):
                return
            self.scanner = None
            if scanner.failed and not scanner.calls_made:
                self._content(
                    self.OPEN, events
                )  # not a call: the tag is text, and what follows is looked at again
            elif scanner.done:
                self.closing = True

    def _finish(self, events: list) -> None:
        if self.scanner is not None:
            self._finish_scanner(events, self.OPEN)
        if self.closing and self.CLOSE.startswith(self.pending.lstrip()):
            self.pending = ""
