"""The outputs a grammar makes: a JSON array of calls (tool_choice required) or one function's arguments
(tool_choice naming it)."""

import json

from backend.server.tools.parsers.base import ToolParser, held
from backend.server.tools.scanner import CallArguments, CallEnd, CallScanner, CallStart


class JsonArrayParser(ToolParser):
    """The whole output is `[{"name": ..., "arguments": {...}}, ...]`."""

    name = "json"
    forced = True

    def __init__(self, strip: tuple[str, ...] = ()):
        super().__init__(strip)
        self.scanner: CallScanner | None = CallScanner(array=True)

    def _content(self, text: str, events: list) -> None:
        pass  # the array's own syntax (a call cut short before its name)

    def _advance(self, events: list) -> None:
        if self.scanner is None:
            self._pass_content(events, ())
        elif self._scan(self.scanner, events):
            if self.scanner.failed and not self.scanner.calls_made:
                self._content(self.scanner.rest, events)
                self.pending = ""
            self.scanner = None

    def _finish(self, events: list) -> None:
        if self.scanner is not None:
            self._finish_scanner(events)


class NamedParser(ToolParser):
    """The whole output is the arguments of the one function tool_choice names."""

    name = "named"
    forced = True

    def __init__(self, function: str, strip: tuple[str, ...] = ()):
        super().__init__(strip)
        self.function = function
        self.text = ""
        self.started = False

    def _advance(self, events: list) -> None:
        if not self.started:
            self.started = True
            self.num_calls = 1
            events.append(CallStart(0, self.function))
        text = self.pending
        for token in self.strip:
            text = text.replace(token, "")
        keep = held(text, self.strip)
        self.pending = text[len(text) - keep:]
        if text[:len(text) - keep]:
            self.text += text[:len(text) - keep]
            events.append(CallArguments(0, text[:len(text) - keep]))

    def finish(self) -> list:
        events: list = []
        self._advance(events)
        try:
            valid = isinstance(json.loads(self.text), dict)
        except json.JSONDecodeError:
            valid = False
        events.append(CallEnd(0, self.text, valid))
        self.pending = ""
        return events
