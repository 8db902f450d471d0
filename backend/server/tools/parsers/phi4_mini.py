"""Phi-4-mini: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]<|/tool_call|>`. The model also writes the
calls as bare objects separated by commas, leaves the closing marker out, or (as vLLM reads it) writes
`functools[...]`; all of these are calls."""

from backend.server.tools.parsers.base import ToolParser
from backend.server.tools.scanner import CallScanner


class Phi4MiniParser(ToolParser):
    name = "phi4_mini_json"
    OPEN, CLOSE, FUNCTOOLS = "<|tool_call|>", "<|/tool_call|>", "functools"
    markers = (OPEN, CLOSE)

    def __init__(self, strip: tuple[str, ...] = ()):
        super().__init__(strip)
        self.scanner: CallScanner | None = None
        self.opened: str | None = None  # the marker before the calls being read
        # where the text is: "calls" after a marker, "more" after calls (a comma or the closing marker may follow), "next" after it
        self.after: str | None = None

    def _advance(self, events: list) -> None:
        while True:
            if self.scanner is not None:
                if not self._scan(self.scanner, events):
                    return
                scanner, self.scanner = self.scanner, None
                if scanner.failed and not scanner.calls_made:
                    self._content(self.opening, events)  # not a call: the marker is text
                    self.after = None
                else:
                    self.after = "more" if scanner.done else None
                continue
            if self.after is not None:
                if not self._start_value(events):
                    return
                continue
            marker = self._through((self.OPEN, self.FUNCTOOLS + "["), events)
            if marker is None:
                return
            if marker != self.OPEN:
                self.pending = "[" + self.pending  # functools' bracket opens the array
            self.opening, self.after = marker, "calls"

    def _start_value(self, events: list) -> bool:
        """After a marker, a bare call or a comma: start reading the next value; False while the text says too
        little."""
        stripped = self.pending.lstrip()
        if self.after == "more":
            if not stripped or self.CLOSE.startswith(stripped):
                return False
            if stripped.startswith(self.CLOSE):
                self.pending, self.after = stripped[len(self.CLOSE) :], None
            elif stripped.startswith(","):
                self.pending, self.opening, self.after = stripped[1:], ",", "next"
            else:
                self.after = None  # the calls have ended: what follows is the answer's text
            return True
        if not stripped:
            return False
        if stripped[0] not in "[{":
            self._content(self.opening, events)
            self.after = None
            return True
        self.pending = stripped
        self.scanner = CallScanner(array=stripped[0] == "[", first_index=self.num_calls)
        self.after = None
        return True

    def _finish(self, events: list) -> None:
        if self.scanner is not None:
            self._finish_scanner(events, self.opening)
        if self.after in ("calls", "next") and not self.pending.strip():
            self._content(self.opening, events)
        if self.after == "more" and self.CLOSE.startswith(self.pending.strip()):
            self.pending = ""
