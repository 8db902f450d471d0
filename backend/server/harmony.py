"""gpt-oss's harmony output format read as reasoning, answer and tool calls, whole or as it is generated.

Written from OpenAI's published description of the format ("OpenAI Harmony Response Format", the gpt-oss model
card): the output is a run of messages, each `<|start|>{header}<|message|>{body}` closed by `<|end|>`, `<|call|>`
(a tool call) or `<|return|>` (the last); the generation prompt has already written the first `<|start|>assistant`.
The header names the channel (`<|channel|>analysis`, `commentary` or `final`) and, for a call, the recipient
(`to=functions.NAME`, before or after the channel) and the body's type (`<|constrain|>json`). The markers are
special tokens: the output is detokenized with them kept (chat.py).

analysis is reasoning; final, and commentary addressed to no one (a preamble the user may see), the answer; a
commentary message to `functions.NAME` a tool call, handed to the tool-call parser as the Hermes text it reads
(`<tool_call>{"name": ..., "arguments": ...}</tool_call>`), so that calls after the reasoning parse as every
model's do. Output without any harmony marker is all answer.
(OpenAI's openai-harmony library parses token ids of its own vocabulary, which it downloads at first use; the
server's readers take detokenized text, so this reads the text.)
"""

import json
import re

from backend.server.reasoning_delta import ReasoningDelta

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_LONGEST = max(len(m) for m in (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS))


def _held_tail(text: str) -> int:
    """How many characters at text's end could begin a marker (held until the next piece tells)."""
    at = text.rfind("<")
    if at < 0 or len(text) - at >= _LONGEST or "|>" in text[at:]:
        return 0
    tail = text[at:]
    return len(tail) if any(m.startswith(tail) for m in (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)) else 0


class HarmonyReader:
    """One choice's text (special tokens kept), fed as it is generated, as reasoning and answer deltas; tool calls
    come out in the answer as Hermes call text."""

    def __init__(self):
        self.state = "header"  # header: reading a message's header; body: its body
        self.held = ""
        self.channel: str | None = None
        self.recipient: str | None = None
        self.call_body = ""
        self.seen_marker = False  # any harmony marker yet (else the text is all answer, given at the end)

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        self.held += text
        while True:
            if self.state == "header":
                at = self.held.find(MESSAGE)
                if at < 0:
                    self.seen_marker = self.seen_marker or "<|" in self.held
                    return out
                self._open(self.held[:at])
                self.state, self.held = "body", self.held[at + len(MESSAGE) :]
            found = [(self.held.find(m), m) for m in ENDS if m in self.held]
            if not found:
                keep = _held_tail(self.held)
                self._body(self.held[: len(self.held) - keep], out)
                self.held = self.held[len(self.held) - keep :]
                return out
            at, marker = min(found)
            self._body(self.held[:at], out)
            self._close(out)
            rest = self.held[at + len(marker) :]
            self.held = rest[len(START) :] if rest.startswith(START) else rest
            self.state = "header"

    def finish(self) -> ReasoningDelta:
        """What is held once the text has ended (a stop token ends the last message without its marker)."""
        out, held = ReasoningDelta(), self.held
        self.held = ""
        if self.state == "header":
            if not self.seen_marker:
                out.content = held  # no harmony at all: the text as written
            return out
        self._body(held, out)
        self._close(out)
        return out

    def _open(self, header: str) -> None:
        self.seen_marker = True
        channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
        self.channel = channel.group(1) if channel else None
        self.recipient = recipient.group(1) if recipient else None
        self.call_body = ""

    def _body(self, text: str, out: ReasoningDelta) -> None:
        if not text:
            return
        if self.recipient is not None:
            self.call_body += text
        elif self.channel == "analysis":
            out.reasoning += text
        else:
            out.content += text

    def _close(self, out: ReasoningDelta) -> None:
        if self.recipient is not None:
            out.content += call_text(self.recipient, self.call_body)
        self.channel = self.recipient = None
        self.call_body = ""


def call_text(recipient: str, body: str) -> str:
    """A harmony call as the Hermes text the tool-call parser reads: `functions.NAME` called with the body's JSON
    arguments (a body that is not JSON passed as its text)."""
    name = recipient.removeprefix("functions.")
    try:
        arguments = json.loads(body)
    except ValueError:
        arguments = body
    return (
        f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"
    )


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages for gpt-oss's chat template, which reads an assistant message's reasoning sent back as `thinking`
    (reasoning_content, vLLM's field and ours, otherwise)."""
    return [
        {**m, "thinking": m["reasoning_content"]} if m.get("reasoning_content") and "thinking" not in m else m
        for m in messages
    ]
