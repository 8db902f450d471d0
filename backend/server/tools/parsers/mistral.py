"""Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or v11's `[TOOL_CALLS]name[ARGS]{...}`."""

import json
import re

from backend.server.tools.parsers.base import ToolParser
from backend.server.tools.scanner import CallArguments, CallEnd, CallScanner, CallStart

_NAME = re.compile(r"\s*([A-Za-z0-9_.-]+)\[ARGS\]")


class MistralParser(ToolParser):
    name = "mistral"
    TAG = "[TOOL_CALLS]"
    markers = (TAG,)
    opening = TAG

    def __init__(self, strip: tuple[str, ...] = ()):
        super().__init__(strip)
        self.scanner: CallScanner | None = None
        self.after_tag = False
        self.v11: tuple[str, int] | None = None  # (name, index) of a `name[ARGS]{...}` call being read

    def _advance(self, events: list) -> None:
        while True:
            if self.v11 is not None:
                if not self._v11_arguments(events):
                    return
                continue
            if self.scanner is not None:
                if not self._scan(self.scanner, events):
                    return
                scanner, self.scanner = self.scanner, None
                if scanner.failed and not scanner.calls_made:
                    self._content(self.TAG, events)
                continue
            if self.after_tag:
                stripped = self.pending.lstrip()
                if not stripped:
                    return
                self.after_tag = False
                if stripped.startswith("["):
                    self.pending = stripped
                    self.scanner = CallScanner(array=True, first_index=self.num_calls)
                    continue
                match = _NAME.match(self.pending)
                if match:
                    self.pending = self.pending[match.end() :]
                    self.v11 = (match.group(1), self.num_calls)
                    self.num_calls += 1
                    events.append(CallStart(self.v11[1], self.v11[0]))
                    continue
                if re.fullmatch(r"\s*[A-Za-z0-9_.-]*(\[A?R?G?S?)?", self.pending):
                    self.after_tag = True
                    return  # a name, its [ARGS] still arriving
                self._content(self.TAG, events)
                continue
            if self._through((self.TAG,), events) is None:
                return
            self.after_tag = True

    def _v11_arguments(self, events: list) -> bool:
        """Read the JSON object of a v11 call; True once it is complete (handed on whole)."""
        end = _json_value_end(self.pending)
        if end is None:
            return False
        name, index = self.v11
        raw = self.pending[:end].strip()
        self.pending = self.pending[end:]
        self.v11 = None
        try:
            valid = isinstance(json.loads(raw), dict)
        except json.JSONDecodeError:
            valid = False
        events.append(CallArguments(index, raw))
        events.append(CallEnd(index, f"{self.TAG}{name}[ARGS]{raw}", valid))
        return True

    def _finish(self, events: list) -> None:
        if self.v11 is not None:
            name, index = self.v11
            events.append(CallArguments(index, self.pending))
            events.append(CallEnd(index, f"{self.TAG}{name}[ARGS]{self.pending}", False))
            self.pending, self.v11 = "", None
        if self.scanner is not None:
            self._finish_scanner(events, self.TAG)
        if self.after_tag:
            self._content(self.TAG, events)


def _json_value_end(text: str) -> int | None:
    """Where the JSON object or array at the start of text (after whitespace) ends, or None if not yet."""
    depth, in_string, escape = 0, False, False
    for i, c in enumerate(text):
        if in_string:
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth <= 0:
                return i + 1
        elif depth == 0 and c not in " \t\r\n":
            return i + 1  # not an object: one character is enough to say it is invalid
    return None
