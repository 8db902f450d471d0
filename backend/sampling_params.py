"""Per-request sampling settings, validated when they are made (vLLM's names and meanings)."""

import json
import math
from dataclasses import InitVar, dataclass, field, fields

# Below this a temperature scales logits past what floating point holds (1e-300 gives NaN probabilities);
# it means "greedy" in practice, as in vLLM.
GREEDY_TEMPERATURE = 1e-5
INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1
MAX_STOP_STRINGS, MAX_STOP_LENGTH = 64, 1024  # every step searches each new text for every stop string


class InvalidParameter(ValueError):
    """A sampling setting out of its range; `param` names the field (the server reports it)."""

    def __init__(self, param: str, message: str, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code  # code: the OpenAI error code the server reports, where one fits


@dataclass(frozen=True)
class Range:
    """A setting's allowed values: low to high (None: no bound), each end included unless open."""

    low: float
    high: float | None = None
    low_open: bool = False

    def holds(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        return above and (self.high is None or value <= self.high)

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"


# The engine's ranges of the real-valued settings (vLLM's); an API's documented range may narrow one (ApiFields)
RANGES = {"temperature": Range(0), "top_p": Range(0, 1, low_open=True), "min_p": Range(0, 1),
          "presence_penalty": Range(-2, 2), "frequency_penalty": Range(-2, 2),
          "repetition_penalty": Range(0, low_open=True)}
NOTES = {"temperature": " (0 is greedy)", "repetition_penalty": " (1 means none)"}


@dataclass(frozen=True)
class ApiFields:
    """How one API's request carries the settings: the field that holds each (SamplingParams' name -> the
    request's, for errors that name what the client sent) and the ranges its reference documents, each within
    the engine's (RANGES)."""

    names: dict[str, str] = field(default_factory=dict)
    ranges: dict[str, Range] = field(default_factory=dict)

    def name(self, setting: str) -> str:
        return self.names.get(setting, setting)


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
    # (<think> id, </think> id, whether the prompt opened the block): guided_json holds after the think block
    think_first: tuple[int, int, bool] | None = None
    # token id -> a number added to its logit before sampling (OpenAI's and vLLM's logit_bias), kept in [-100, 100]
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens may be sampled
    # vLLM's: the logprob of each prompt token given those before it (the first has none), with this many of the
    # most likely tokens besides; computed in the prefill, which then skips the prefix cache
    prompt_logprobs: int | None = None
    # the API the settings came in by (its field names and ranges), for the server; not kept
    api: InitVar[ApiFields | None] = None

    def __post_init__(self, api: ApiFields | None) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate(api or ApiFields())

    def _validate(self, api: ApiFields) -> None:
        """Each rule of a setting, with its one message, naming the field as the request's API names it."""
        def bad(name: str, allowed: str) -> InvalidParameter:
            shown = api.name(name)
            return InvalidParameter(shown, f"{shown} must be {allowed}, got {getattr(self, name)!r}")

        def integer(name: str) -> bool:
            value = getattr(self, name)
            return isinstance(value, int) and not isinstance(value, bool)

        for name in RANGES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, "a finite number")
        if not integer("n") or self.n < 1:
            raise bad("n", "an integer >= 1")
        for name, engine_range in RANGES.items():
            allowed = api.ranges.get(name, engine_range)
            if not allowed.holds(getattr(self, name)):
                raise bad(name, f"{allowed}{NOTES.get(name, '')}")
        if not integer("top_k") or not 0 <= self.top_k < 2**31:
            raise bad("top_k", "an integer >= 1 (at most the vocabulary size), or 0 / -1 for no limit")
        if self.max_tokens is not None and (not integer("max_tokens") or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1")
        if self.logprobs is not None and (not integer("logprobs") or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "an integer in [0, 20]")
        if self.prompt_logprobs is not None and (not integer("prompt_logprobs") or not 0 <= self.prompt_logprobs <= 20):
            raise bad("prompt_logprobs", "an integer in [0, 20]")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list) or not ids or any(
                    not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
                raise bad("allowed_token_ids", "a non-empty list of token ids (integers >= 0)")
        if any(not isinstance(s, str) or not s or len(s) > MAX_STOP_LENGTH for s in self.stop):
            raise bad("stop", f"a non-empty string or a list of them, each at most {MAX_STOP_LENGTH} characters")
        if len(self.stop) > MAX_STOP_STRINGS:
            shown = api.name("stop")
            raise InvalidParameter(shown, f"{shown} takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < 2**63 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of token ids >= 0")
        if self.seed is not None and (not integer("seed") or not INT64_MIN <= self.seed <= UINT64_MAX):
            raise bad("seed", f"an integer in [{INT64_MIN}, {UINT64_MAX}]")
        if isinstance(self.guided_json, str):
            try:
                self.guided_json = json.loads(self.guided_json)
            except json.JSONDecodeError as e:
                raise InvalidParameter("guided_json", f"guided_json must be a JSON schema: {e}") from None
        if self.guided_json is not None and self.guided_json is not True and not isinstance(self.guided_json, dict):
            raise bad("guided_json", "a JSON schema (an object) or true for any JSON value")
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def sequence_seed(self, index: int) -> int | None:
        """The seed of the request's index-th sequence: seed + index, wrapped into the 64 bits a generator takes."""
        return None if self.seed is None else (self.seed + index) % 2**64


MAX_LOGIT_BIAS = 300  # OpenAI takes up to 300 entries


def _logit_bias(bias) -> dict[int, float] | None:
    """{token id: bias}, ids as integers (or their decimal strings, as JSON carries them), biases clamped to
    [-100, 100] as OpenAI's range (vLLM clamps too); the ids are checked against the vocabulary by the engine."""
    if not isinstance(bias, dict):
        raise InvalidParameter("logit_bias", f"logit_bias must map token ids to numbers, got {bias!r}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidParameter("logit_bias", f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key) if not isinstance(key, bool) else None
        except (TypeError, ValueError):
            token = None
        if token is None or token < 0 or (isinstance(key, str) and not key.strip().isdigit()):
            raise InvalidParameter("logit_bias", f"logit_bias: {key!r} is not a token id (an integer >= 0)")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidParameter("logit_bias", f"logit_bias[{key!r}] must be a number, got {value!r}")
        out[token] = float(min(max(value, -100.0), 100.0))
    return out or None


def as_sampling_params(params: "SamplingParams | dict | None") -> SamplingParams:
    """SamplingParams as given, from a dict of its fields, or the defaults (None)."""
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, dict):
        known = {f.name for f in fields(SamplingParams)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"unknown sampling setting(s) {', '.join(unknown)}; SamplingParams takes "
                             f"{', '.join(sorted(known))}")
        return SamplingParams(**params)
    raise ValueError(f"sampling params are a SamplingParams or a dict of its fields, got {type(params).__name__}")
