"""Per-request sampling settings, validated when they are made (vLLM's names and meanings)."""

import json
from dataclasses import dataclass, field


class InvalidParameter(ValueError):
    """A sampling setting out of its range; `param` names the field (the server reports it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the model's context length
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # how many top logprobs to return besides the sampled token's
    skip_special_tokens: bool = True
    guided_json: dict | str | bool | None = None  # a JSON schema the output must match, or True for any JSON

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, allowed: str) -> InvalidParameter:
            return InvalidParameter(name, f"{name} must be {allowed}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", ">= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "an integer >= 1, or 0 / -1 for no limit")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "in [-2, 2]")
        if not self.repetition_penalty > 0:
            raise bad("repetition_penalty", "> 0 (1 means none)")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "an integer in [0, 20]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of token ids >= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "an integer")
        if isinstance(self.guided_json, str):
            try:
                self.guided_json = json.loads(self.guided_json)
            except json.JSONDecodeError as e:
                raise InvalidParameter("guided_json", f"guided_json must be a JSON schema: {e}") from None
        if self.guided_json is not None and self.guided_json is not True and not isinstance(self.guided_json, dict):
            raise bad("guided_json", "a JSON schema (an object) or true for any JSON value")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
