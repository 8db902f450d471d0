"""A choice's generated text as OpenAI's assistant message: content and tool_calls, whole or as deltas.

Both ways read the same parser events, and hold whitespace the same way (whitespace at the end of the
content is held until more content follows, and dropped when the message ends in calls), so a streamed
message adds up to the non-streamed one. They differ only for text that looked like a call but did not
parse: the whole message gives it back as content; a stream has already sent the call's start.
"""

import uuid
from dataclasses import dataclass, field

from backend.server.tools.parsers import Content, ToolParser
from backend.server.tools.scanner import CallArguments, CallEnd, CallStart


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class _ContentGate:
    def __init__(self):
        self.held = ""

    def add(self, text: str) -> str:
        body = text.rstrip()
        if not body:
            self.held += text
            return ""
        out, self.held = self.held + body, text[len(body):]
        return out

    def end(self, calls: bool) -> str:
        out, self.held = ("" if calls else self.held), ""
        return out


@dataclass
class MessageDelta:
    content: str = ""
    reasoning: str = ""  # backend/server/reasoning.py's, ahead of the content
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI's delta.tool_calls entries


class ToolCallStream:
    """One choice's text, fed as it is generated, as content and tool-call deltas."""

    def __init__(self, parser: ToolParser, parallel: bool = True):
        self.parser, self.parallel = parser, parallel
        self.gate = _ContentGate()
        self.calls: dict[int, ToolCall] = {}

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str) -> MessageDelta:
        return self._read(self.parser.feed(text) if text else [])

    def read(self, text: str, finished: bool) -> list[MessageDelta]:
        """A piece of the choice's text as deltas; the last piece (finished) flushes what the parser holds."""
        return [self.feed(text), self.finish()] if finished else [self.feed(text)]

    def finish(self) -> MessageDelta:
        delta = self._read(self.parser.finish())
        delta.content += self.gate.end(self.has_calls)
        return delta

    def _read(self, events: list) -> MessageDelta:
        delta = MessageDelta()
        for e in events:
            if isinstance(e, Content):
                delta.content += self.gate.add(e.text)
            elif not self.parallel and e.index > 0:
                continue
            elif isinstance(e, CallStart):
                call = self.calls[e.index] = ToolCall(new_call_id(), e.name)
                delta.tool_calls.append({"index": e.index, "id": call.id, "type": "function",
                                         "function": {"name": e.name, "arguments": ""}})
            elif isinstance(e, CallArguments) and e.index in self.calls:
                self.calls[e.index].arguments += e.text
                delta.tool_calls.append({"index": e.index, "function": {"arguments": e.text}})
        return delta


def parse_message(parser: ToolParser, text: str, parallel: bool = True) -> tuple[str, list[ToolCall]]:
    """A whole text as (content, calls); what looked like a call but is not one stays content."""
    gate, content = _ContentGate(), ""
    calls: dict[int, ToolCall] = {}
    for e in parser.feed(text) + parser.finish():
        if isinstance(e, Content):
            content += gate.add(e.text)
        elif isinstance(e, CallStart):
            calls[e.index] = ToolCall("", e.name)
        elif isinstance(e, CallArguments) and e.index in calls:
            calls[e.index].arguments += e.text
        elif isinstance(e, CallEnd) and not e.valid and not parser.forced:
            calls.pop(e.index, None)
            content += gate.add(e.raw)
    found = [calls[i] for i in sorted(calls)]
    if not parallel:
        found = found[:1]
    for call in found:
        call.id = new_call_id()
    return content + gate.end(bool(found)), found
