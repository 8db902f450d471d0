"""What a reasoning reader hands on from a piece of a choice's text: reasoning, then answer."""

from dataclasses import dataclass


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""

    def __iadd__(self, other: "ReasoningDelta") -> "ReasoningDelta":
        self.reasoning += other.reasoning
        self.content += other.content
        return self
