"""The `speculative=` setting of LLM(...) and of `serve --speculative`."""

import json
from dataclasses import dataclass, fields

from backend.speculative.vocab_bridge import VOCAB_METHODS

METHODS = ("ngram", "draft")


@dataclass
class SpeculativeConfig:
    method: str
    num_tokens: int | str = "auto"  # drafts per step, or "auto": chosen per request from its acceptance rate
    max_num_tokens: int = 8  # the most "auto" may pick
    prompt_lookup_min: int = 2  # n-gram: shortest suffix looked up in the request's own tokens
    prompt_lookup_max: int = 5  # n-gram: longest
    model: str | None = None  # draft: an alias, Hugging Face directory or .gguf
    # draft: how its vocabulary meets the target's (spec/vocab_bridge.py): "shared" (the same), "intersection"
    # (token-level intersection: it proposes the tokens both have), "string" (greedy requests: its text, tokenized
    # by the target's tokenizer; string_drafts.py), "auto" (shared when it is, else by how many tokens both have)
    vocab: str = "auto"
    # Speculation pauses for a step when more sequences than this are decoding: verifying k extra tokens
    # per sequence then costs more than it saves (bench/speculative.py measures where).
    max_batch_size: int = 4
    # Cost of verifying one more token relative to a decode step, for "auto": about 0.06 measured for
    # SmolLM2-135M on a 2-core CPU at batch 1 (memory-bound: extra query rows are nearly free).
    verify_cost: float = 0.06

    @property
    def max_drafts(self) -> int:
        """The most drafts one sequence gets in a step."""
        return self.num_tokens if isinstance(self.num_tokens, int) else self.max_num_tokens

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative must be a JSON object, e.g. '{{\"method\": \"ngram\"}}' ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative must be a dict such as {{'method': 'ngram'}}, got {value!r}")
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise ValueError(f"speculative: unknown setting(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
        if "method" not in value:
            raise ValueError(f"speculative needs a method: one of {', '.join(METHODS)}")
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported; use one of {', '.join(METHODS)}")
        k = self.num_tokens
        if not (k == "auto" or (isinstance(k, int) and 1 <= k <= 16)):
            raise ValueError(f"speculative num_tokens must be \"auto\" or an integer in [1, 16], got {k!r}")
        if not 1 <= self.max_num_tokens <= 16:
            raise ValueError(f"speculative max_num_tokens must be in [1, 16], got {self.max_num_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative prompt_lookup_min must be >= 1 and <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.method == "draft" and not self.model:
            raise ValueError("speculative method 'draft' needs a model: {\"method\": \"draft\", \"model\": ...}")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative method 'ngram' takes no model; use method 'draft' for a draft model")
        if self.vocab not in VOCAB_METHODS:
            raise ValueError(f"speculative vocab {self.vocab!r} is not supported; use one of {', '.join(VOCAB_METHODS)}")
        if self.max_batch_size < 1:
            raise ValueError(f"speculative max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.verify_cost < 0:
            raise ValueError(f"speculative verify_cost must be >= 0, got {self.verify_cost}")
