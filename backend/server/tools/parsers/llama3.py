"""Llama 3.1-3.3 JSON tool calling: the output is `{"name": ..., "parameters": {...}}`, after `<|python_tag|>`
or not, calls separated by `;`."""

from backend.server.tools.parsers.base import ToolParser
from backend.server.tools.scanner import CallScanner


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"
    markers = (TAG,)

    def __init__(self, strip: tuple[str, ...] = ()):
        super().__init__(strip)
        self.mode = "start"  # start, calls, between, content
        self.scanner: CallScanner | None = None

    def _advance(self, events: list) -> None:
        while True:
            if self.mode == "content":
                self._pass_content(events, ())
                return
            if self.mode == "calls":
                if not self._scan(self.scanner, events):
                    return
                scanner, self.scanner = self.scanner, None
                self.mode = "between" if scanner.done else "content"
                continue
            stripped = self.pending.lstrip()
            for token in self.strip:  # <|eom_id|> after a call, say
                stripped = stripped.removeprefix(token).lstrip()
            if not stripped or any(t.startswith(stripped) for t in self.strip):
                return  # wait for more
            if self.mode == "start":
                if stripped.startswith(self.TAG):
                    stripped = stripped[len(self.TAG):]
                elif self.TAG.startswith(stripped):
                    return
                elif not stripped.startswith("{"):
                    self.mode = "content"  # an answer, not calls
                    continue
            elif stripped.startswith(";"):
                stripped = stripped[1:]
            else:
                self.mode = "content"  # text after the calls
                continue
            self.pending = stripped
            self.scanner = CallScanner(first_index=self.num_calls)
            self.mode = "calls"

    def _finish(self, events: list) -> None:
        if self.scanner is not None:
            self._finish_scanner(events)
