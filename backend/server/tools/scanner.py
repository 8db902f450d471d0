"""Tool calls read out of JSON text as it arrives: `{"name": ..., "arguments": {...}}` objects, alone or in
an array, with each call's name known as soon as it is complete and its arguments handed on in pieces.

The scanner follows JSON's structure (strings, nesting) character by character, without building values;
each call object is checked whole with json.loads when it closes. The arguments are passed on as the raw
text the model wrote, so the streamed pieces add up to exactly the arguments of the finished call.
"""

import json
from dataclasses import dataclass

ARGUMENT_KEYS = ("arguments", "parameters")  # OpenAI/Hermes/Mistral say arguments, Llama 3 parameters
WHITESPACE = " \t\r\n"


@dataclass
class CallStart:
    index: int
    name: str


@dataclass
class CallArguments:
    index: int
    text: str


@dataclass
class CallEnd:
    index: int
    raw: str  # the call's whole text, for when it turns out not to be a call after all
    valid: bool


@dataclass
class _Call:
    start: int  # where its object begins in the buffer
    name: str | None = None
    args_start: int | None = None  # where its arguments' value begins
    args_end: int | None = None
    args_is_string: bool = False  # arguments given as a JSON string holding the object
    started: bool = False
    sent: int = 0  # characters of the arguments handed on


def _object_arguments(value) -> str | None:
    """The arguments as the JSON text of an object, or None when they are not one."""
    if isinstance(value, dict):
        return None  # the raw text is used
    if isinstance(value, str):
        try:
            inner = json.loads(value)
        except json.JSONDecodeError:
            return ""
        return value if isinstance(inner, dict) else ""
    return ""


class CallScanner:
    """One JSON value of tool calls: an object (array=False) or an array of objects. feed() takes text and
    returns events; once the value is closed, `done` is set and `rest` holds the text after it. A text
    that cannot be calls sets `failed` (with whatever was consumed in `buffer`)."""

    def __init__(self, array: bool = False, first_index: int = 0):
        self.array = array
        self.call_depth = 2 if array else 1
        self.buffer = ""
        self.stack: list[str] = []
        self.in_string = self.escape = False
        self.string_start = 0
        self.key: str | None = None
        self.expect = "value"  # inside a call object: key, colon, value, comma
        self.value_start: int | None = None  # a primitive value being read at call level
        self.call: _Call | None = None
        self.first_index = self.next_index = first_index  # next_index: the index the next call would get
        self.done = self.failed = False
        self.end = self.fail_at = self.resume = 0
        self.rest = ""

    @property
    def calls_made(self) -> int:
        return self.next_index - self.first_index

    @property
    def started(self) -> bool:
        """A call is open and has been announced."""
        return self.call is not None and self.call.started

    def feed(self, text: str) -> list:
        events: list = []
        offset = len(self.buffer)
        self.buffer += text
        for i in range(offset, len(self.buffer)):
            if self.done or self.failed:
                break
            self._char(i, self.buffer[i], events)
            if self.failed:
                self.fail_at = i
        if self.done:
            self.rest = self.buffer[self.end:]
            self.buffer = self.buffer[:self.end]
        if self.failed:
            started = self.started
            if started:
                events.append(CallEnd(self.next_index - 1, self.buffer[self.call.start:self.fail_at], False))
            # Text that began no call is handed back whole; after a broken call, from where it broke.
            self.rest = self.buffer[self.fail_at:] if started else self.buffer[self.resume:]
            self.call = None
        else:
            self._flush(events)
        return events

    def finish(self) -> list:
        """The text has ended: a call left open is not valid."""
        events: list = []
        if self.call is not None and not self.failed:
            self._flush(events)
            if self.call.started:
                events.append(CallEnd(self.next_index - 1, self.buffer[self.call.start:], False))
            self.call = None
        return events

    # Events ---------------------------------------------------------------------------------------------

    def _flush(self, events: list) -> None:
        call = self.call
        if call is None or call.name is None:
            return
        if not call.started:
            call.started = True
            events.append(CallStart(self.next_index, call.name))
            self.next_index += 1
        if call.args_start is not None and not call.args_is_string:
            end = call.args_end if call.args_end is not None else len(self.buffer)
            if end - call.args_start > call.sent:
                events.append(CallArguments(self.next_index - 1, self.buffer[call.args_start + call.sent:end]))
                call.sent = end - call.args_start

    def _close_call(self, end: int, events: list) -> None:
        call = self.call
        raw = self.buffer[call.start:end]
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = None
        valid = isinstance(value, dict) and isinstance(value.get("name"), str)
        args = None
        if valid:
            key = next((k for k in ARGUMENT_KEYS if k in value), None)
            args = "{}" if key is None else _object_arguments(value[key])
            valid = args != ""
        if call.name is None:  # never started: not a call
            self.failed = True
            return
        self._flush(events)
        if valid and args is not None and call.sent == 0:  # string arguments, or none: handed on whole
            events.append(CallArguments(self.next_index - 1, args))
        events.append(CallEnd(self.next_index - 1, raw, valid))
        self.call = None
        self.resume = end

    # The character machine --------------------------------------------------------------------------------

    def _char(self, i: int, c: str, events: list) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                self._string_end(i)
            return
        depth = len(self.stack)
        if depth == self.call_depth and self.stack[-1] == "{":
            self._call_level(i, c, events)
            return
        if c in WHITESPACE:
            return
        if depth < self.call_depth:  # outside any call: the array, or before the value
            if depth == 0 and not self.stack and self.array and c == "[":
                self.stack.append("[")
                self.expect = "value"
            elif c == "{" and depth == self.call_depth - 1 and self.expect == "value":
                self.stack.append("{")
                self.call = _Call(start=i)
                self.expect = "key"
            elif c == "," and self.array and depth == 1 and self.expect == "comma":
                self.expect = "value"
            elif c == "]" and self.array and depth == 1 and self.expect in ("comma", "value"):
                self.stack.pop()
                self._finish_value(i + 1)
            else:
                self.failed = True
            return
        # inside a value nested in a call (its arguments, most often)
        if c == '"':
            self.in_string, self.string_start = True, i
        elif c in "{[":
            self.stack.append(c)
        elif c in "}]":
            if (c == "}") != (self.stack[-1] == "{"):
                self.failed = True
                return
            self.stack.pop()
            if len(self.stack) == self.call_depth:
                self._value_end(i + 1)

    def _call_level(self, i: int, c: str, events: list) -> None:
        if self.value_start is not None:  # a number, true, false or null: it ends at whitespace, "," or "}"
            if c not in WHITESPACE and c not in ",}":
                return
            self._value_end(i)
        if c in WHITESPACE:
            return
        if self.expect == "key":
            if c == '"':
                self.in_string, self.string_start = True, i
            elif c == "}" and self.call is not None and self.call.name is None and self.key is None:
                self.failed = True
            else:
                self._end_of_object(i, c, events)
        elif self.expect == "colon":
            if c != ":":
                self.failed = True
            self.expect = "value"
        elif self.expect == "value":
            self._value_start(i, c)
        elif self.expect == "comma":
            if c == ",":
                self.expect = "key"
            else:
                self._end_of_object(i, c, events)

    def _end_of_object(self, i: int, c: str, events: list) -> None:
        if c != "}":
            self.failed = True
            return
        self.stack.pop()
        self._close_call(i + 1, events)
        if self.failed:
            return
        if self.array:
            self.expect = "comma"
        else:
            self._finish_value(i + 1)

    def _value_start(self, i: int, c: str) -> None:
        if self.call.name is None and self.key not in ("name", *ARGUMENT_KEYS):
            self.failed = True  # a call's first key is its name or its arguments
            return
        if self.key in ARGUMENT_KEYS and self.call.args_start is None:
            self.call.args_start = i
            self.call.args_is_string = c == '"'
        if c == '"':
            self.in_string, self.string_start = True, i
        elif c in "{[":
            self.stack.append(c)
        elif c in "}],:":
            self.failed = True
        else:
            self.value_start = i
        self.expect = "in_value"

    def _string_end(self, i: int) -> None:
        depth = len(self.stack)
        if depth != self.call_depth:
            return  # a string nested in a value
        if self.expect == "key":
            try:
                self.key = json.loads(self.buffer[self.string_start:i + 1])
            except json.JSONDecodeError:
                self.failed = True
            self.expect = "colon"
            return
        self._value_end(i + 1)

    def _value_end(self, end: int) -> None:
        """A value at call level has ended at `end` (exclusive)."""
        start = self.value_start if self.value_start is not None else self.string_start
        self.value_start = None
        call = self.call
        if self.key == "name":
            try:
                name = json.loads(self.buffer[start:end])
            except json.JSONDecodeError:
                name = None
            if not isinstance(name, str) or not name:
                self.failed = True
                return
            call.name = call.name or name
        elif self.key in ARGUMENT_KEYS and call.args_start is not None and call.args_end is None:
            call.args_end = end
        self.expect = "comma"

    def _finish_value(self, end: int) -> None:
        self.done = True
        self.end = end
