"""What every tool-call parser shares: content events, markers held back, special tokens stripped."""

from backend.server.tools.scanner import CallEnd, CallScanner


class Content:
    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return f"Content({self.text!r})"


def held(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of text could begin one of the markers."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-n:]):
                best = n
                break
    return best


class ToolParser:
    """The base: content passes through, minus special tokens (strip) the detokenizer left in."""

    name = "none"
    markers: tuple[str, ...] = ()  # special tokens this format needs to see in the text
    # A grammar makes the whole output calls (tool_choice required or named): a call cut short by max_tokens stays
    # a call with the arguments written so far, as OpenAI returns it, and the grammar's own syntax is never content.
    forced = False

    def __init__(self, strip: tuple[str, ...] = ()):
        self.strip = tuple(s for s in strip if s and s not in self.markers)
        self.pending = ""
        self.num_calls = 0

    def feed(self, text: str) -> list:
        self.pending += text
        events: list = []
        self._advance(events)
        return events

    def finish(self) -> list:
        events: list = []
        self._advance(events)
        self._finish(events)
        if self.pending:
            self._content(self.pending, events)
            self.pending = ""
        return events

    def _content(self, text: str, events: list) -> None:
        for token in self.strip:
            text = text.replace(token, "")
        if text:
            events.append(Content(text))

    def _pass_content(self, events: list, markers: tuple[str, ...]) -> None:
        """Everything pending is content except a tail that may begin one of the markers (or a stripped token)."""
        keep = held(self.pending, markers + self.strip)
        self._content(self.pending[: len(self.pending) - keep], events)
        self.pending = self.pending[len(self.pending) - keep :]

    def _through(self, markers: tuple[str, ...], events: list) -> str | None:
        """Past the first of the markers in what is pending: the text before it is content, and pending begins
        after it. Returns that marker; None where there is none yet (pending keeps a tail that may begin one)."""
        found = [(at, m) for at, m in ((self.pending.find(m), m) for m in markers) if at >= 0]
        if not found:
            self._pass_content(events, markers)
            return None
        at, marker = min(found)
        self._content(self.pending[:at], events)
        self.pending = self.pending[at + len(marker) :]
        return marker

    opening = ""  # the marker before a scanner's first call, given back with it when that call is not one

    def _scan(self, scanner: CallScanner, events: list) -> bool:
        """Feed what is pending to a scanner; True once it is done or failed (pending then holds the rest)."""
        found = scanner.feed(self.pending)
        self.pending = ""
        events.extend(self._marked(found, scanner))
        self.num_calls = scanner.next_index
        if scanner.done or scanner.failed:
            self.pending = scanner.rest
            return True
        return False

    def _marked(self, events: list, scanner: CallScanner) -> list:
        for e in events:
            if isinstance(e, CallEnd) and not e.valid and e.index == scanner.first_index:
                e.raw = self.opening + scanner.buffer[: scanner.buffer.find(e.raw)] + e.raw
        return events

    def _finish_scanner(self, events: list, opening: str = "") -> None:
        """The text ended inside self.scanner's value: a call it announced ends (invalid); text in which it found
        no call is content, after the marker that opened it."""
        scanner, self.scanner = self.scanner, None
        started = scanner.started
        events.extend(self._marked(scanner.finish(), scanner))
        if not started and not scanner.calls_made:
            self._content(opening + scanner.buffer, events)

    def _advance(self, events: list) -> None:
        self._pass_content(events, ())

    def _finish(self, events: list) -> None:
        pass
