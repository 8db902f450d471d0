"""A reasoning model's output as its reasoning and its answer, whole or as it is generated.

One reader per output format; today the `<think>...</think>` format (Qwen3, SmolLM3, DeepSeek-R1 distills).
The reasoning is what the model writes between `<think>` and `</think>`, a think block opening the output
(or left open by the prompt, as templates that open it in the generation prompt do); everything after the
block is the answer, which the tool-call parser then reads. Whitespace around the reasoning and before the
answer is dropped. gpt-oss's harmony channels (analysis vs final, commentary calls) are read by harmony.py's
reader, with the same feed/finish methods, chosen by reasoning_format below.

Streamed and whole readings agree: a marker split across pieces is held until it is whole, and so is
whitespace at the reasoning's end.
"""

from backend.server.harmony import CHANNEL, HarmonyReader
from backend.server.reasoning_delta import ReasoningDelta
from backend.server.tools.output import MessageDelta, ToolCallStream

REASONING_PARSERS = ("auto", "none", "think", "harmony")  # serve --reasoning-parser
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def reasoning_format(override: str | None, template: str | None) -> str | None:
    """The reasoning format of a model's output: --reasoning-parser's, else its chat template's (None: the output
    is all answer)."""
    if override and override != "auto":
        return None if override == "none" else override
    text = template or ""
    if CHANNEL in text:  # gpt-oss's template writes harmony's channels
        return "harmony"
    return "think" if THINK_OPEN in text or THINK_CLOSE in text else None


def opens_thinking(prompt_text: str) -> bool:
    """Whether a prompt leaves a think block open, so the output starts inside the reasoning (DeepSeek-R1's
    template opens it in the generation prompt; a prefill may too)."""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


def think_marker_ids(tokenizer) -> tuple[int, int] | None:
    """`<think>`'s and `</think>`'s token ids where the vocabulary has each as one token (Qwen3, SmolLM3,
    DeepSeek-R1), else None."""
    ids = [tokenizer.encode(marker, add_special_tokens=False) for marker in (THINK_OPEN, THINK_CLOSE)]
    return (ids[0][0], ids[1][0]) if all(len(i) == 1 for i in ids) else None


def prompt_opens_thinking(tokenizer, prompt: list[int], tail_tokens: int = 256) -> bool:
    """opens_thinking for a prompt's token ids: read backwards for the markers' own ids where each is one token,
    else from the text of the prompt's last tokens."""
    markers = think_marker_ids(tokenizer)
    if markers is not None:
        open_id, close_id = markers
        for tid in reversed(prompt):
            if tid in (open_id, close_id):
                return tid == open_id
        return False
    return opens_thinking(tokenizer.decode(prompt[-tail_tokens:], skip_special_tokens=False))


def effort_switches(effort: str | None) -> dict:
    """A reasoning effort (OpenAI's reasoning_effort, Responses' reasoning.effort) as chat template variables:
    none and minimal turn thinking off where the template has the switch (enable_thinking, as Qwen3's and
    SmolLM3's do); other efforts turn it on and name the effort (reasoning_effort, as gpt-oss's template reads)."""
    if effort is None:
        return {}
    if effort in ("none", "minimal"):
        return {"enable_thinking": False}
    return {"enable_thinking": True, "reasoning_effort": effort}


def _partial_marker(text: str, marker: str) -> int:
    """How many characters at text's end could begin marker (held until the next piece tells)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ThinkReader:
    """One choice's text, fed as it is generated, as reasoning and answer deltas."""

    def __init__(self, in_thinking: bool = False):
        self.state = (
            "thinking" if in_thinking else "start"
        )  # start: not yet known whether a think block opens
        self.held = ""
        self.reasoned = False  # some reasoning has been handed on (its leading whitespace is behind it)

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        self.held += text
        if self.state == "start":
            body = self.held.lstrip()
            if not body or (len(body) < len(THINK_OPEN) and THINK_OPEN.startswith(body)):
                return out
            if not body.startswith(THINK_OPEN):
                self.state = "answer"  # no think block: the text is all answer, as written
                out.content, self.held = self.held, ""
                return out
            self.state, self.held = "thinking", body[len(THINK_OPEN) :]
        if self.state == "thinking":
            at = self.held.find(THINK_CLOSE)
            if at < 0:
                keep = _partial_marker(self.held, THINK_CLOSE)
                body = self.held[: len(self.held) - keep]
                core = body.rstrip()
                out.reasoning = self._reasoning(core)
                self.held = body[len(core) :] + self.held[len(body) :]
                return out
            out.reasoning = self._reasoning(self.held[:at].rstrip())
            self.state, self.held = "lead", self.held[at + len(THINK_CLOSE) :]
        if self.state == "lead":  # the answer's leading whitespace is dropped
            body, self.held = self.held.lstrip(), ""
            if body:
                self.state = "answer"
            out.content = body
            return out
        out.content, self.held = out.content + self.held, ""
        return out

    def finish(self) -> ReasoningDelta:
        """What is held once the text has ended: an unfinished marker is text after all."""
        held, self.held = self.held, ""
        if self.state == "start":
            return ReasoningDelta(content=held)
        if self.state == "thinking":
            return ReasoningDelta(reasoning=self._reasoning(held.rstrip()))
        return ReasoningDelta(content=held.lstrip() if self.state == "lead" else held)

    def _reasoning(self, text: str) -> str:
        if not self.reasoned:
            text = text.lstrip()
            self.reasoned = bool(text)
        return text


def new_reader(fmt: str | None, in_thinking: bool = False) -> ThinkReader | HarmonyReader | None:
    """A fresh reader of one choice's output in this format (None: no reasoning to take apart)."""
    if fmt is None:
        return None
    if fmt == "think":
        return ThinkReader(in_thinking)
    if fmt == "harmony":
        return HarmonyReader()
    raise ValueError(f"unknown reasoning parser {fmt!r}; use one of {', '.join(REASONING_PARSERS)}")


def split_reasoning(fmt: str | None, text: str, in_thinking: bool = False) -> tuple[str | None, str]:
    """A whole text as (reasoning, answer); reasoning None where the format has none or the model wrote none."""
    reader = new_reader(fmt, in_thinking)
    if reader is None:
        return None, text
    whole = reader.feed(text)
    whole += reader.finish()
    return whole.reasoning or None, whole.content


class ChoiceReader:
    """One choice's text as it is generated, read for reasoning first and then, in the answer alone, for tool
    calls: deltas of reasoning, content and tool-call pieces, in that order."""

    def __init__(self, reasoning: ThinkReader | HarmonyReader | None, calls: ToolCallStream | None):
        self.reasoning, self.calls = reasoning, calls

    @property
    def has_calls(self) -> bool:
        return self.calls is not None and self.calls.has_calls

    def read(self, text: str, finished: bool) -> list[MessageDelta]:
        """A piece of the choice's text as deltas; the last piece (finished) flushes what the readers hold."""
        if self.reasoning is None:
            split = ReasoningDelta(content=text)
        else:
            split = self.reasoning.feed(text)
            if finished:
                split += self.reasoning.finish()
        out = [MessageDelta(reasoning=split.reasoning)] if split.reasoning else []
        if self.calls is None:
            return [*out, MessageDelta(content=split.content)] if split.content else out
        return out + [d for d in self.calls.read(split.content, finished) if d.content or d.tool_calls]
