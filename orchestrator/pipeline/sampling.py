"""Sampling settings for each stage of the article pipeline (outline, sections, image prompts): defaults chosen by
bench/article_prose.py on the embedded SmolLM2-135M, overridable per run and recorded in the run's params."""

from dataclasses import asdict, dataclass, field, fields, replace

STAGES = ("outline", "sections", "image_prompts")


class SamplingError(ValueError):
    pass


@dataclass(frozen=True)
class StageSampling:
    temperature: float = 0.7
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        checks = {
            "temperature": (0, 2), "top_p": (1e-6, 1), "min_p": (0, 1), "repetition_penalty": (1e-6, 3),
            "frequency_penalty": (-2, 2), "presence_penalty": (-2, 2),
        }
        for name, (low, high) in checks.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise SamplingError(f"sampling {name} must be a number in [{low:g}, {high:g}], got {value!r}")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise SamplingError(f"sampling stop must be a list of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))

    def request(self) -> dict:
        """The OpenAI-shaped fields of a chat request (temperature and stop travel as the client's own)."""
        return {"top_p": self.top_p, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
                "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty}

    def chat(self) -> dict:
        """Keyword arguments of LLMClient.chat / LLMRouter.chat for this stage."""
        return {"temperature": self.temperature, "stop": list(self.stop) or None, "extra": self.request()}

    def stronger(self) -> "StageSampling":
        """For the loop guard's one rewrite: penalties raised well past the stage's own."""
        return replace(self, repetition_penalty=round(max(self.repetition_penalty, 1.0) + 0.2, 3),
                       frequency_penalty=min(2.0, self.frequency_penalty + 0.6),
                       presence_penalty=min(2.0, self.presence_penalty + 0.4))


# The old pipeline's settings (temperature 0.7, nothing else): bench/article_prose.py's "before" row.
PLAIN = {stage: StageSampling() for stage in STAGES}

# Sections: repetition_penalty 1.15 took the smallest distinct-4 of six sections from 0.912 to 1.0; adding
# frequency/presence penalties and min_p gained nothing and read as run-on sentences. The outline keeps the old
# settings: it is JSON, whose braces and quotes must repeat.
DEFAULTS = {
    "outline": StageSampling(),
    "sections": StageSampling(temperature=0.7, repetition_penalty=1.15),
    "image_prompts": StageSampling(temperature=0.7, repetition_penalty=1.15, stop=("\n",)),
}
# A section whose share of repeated 4-grams is above this is rewritten once with stronger penalties; human
# prose of a section's length stays below 0.03.
LOOP_THRESHOLD = 0.1


@dataclass(frozen=True)
class Sampling:
    stages: dict[str, StageSampling] = field(default_factory=lambda: dict(DEFAULTS))
    loop_threshold: float = LOOP_THRESHOLD

    def __getitem__(self, stage: str) -> StageSampling:
        return self.stages[stage]


def resolve(overrides: dict | None, temperature: float | None = None) -> Sampling:
    """The defaults with a run's overrides ({"sections": {"temperature": 0.5}, "loop_threshold": 0.2}) laid
    over them; a run-wide `temperature` sets every stage's that is not overridden."""
    overrides = dict(overrides or {})
    threshold = overrides.pop("loop_threshold", LOOP_THRESHOLD)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:
        raise SamplingError(f"sampling loop_threshold must be in (0, 1], got {threshold!r}")
    unknown = sorted(set(overrides) - set(STAGES))
    if unknown:
        raise SamplingError(f"unknown sampling stage(s): {', '.join(unknown)}; known: {', '.join(STAGES)}, "
                            "loop_threshold")
    known = {f.name for f in fields(StageSampling)}
    stages = {}
    for stage in STAGES:
        given = overrides.get(stage) or {}
        if not isinstance(given, dict):
            raise SamplingError(f"sampling {stage} must be an object of settings, got {given!r}")
        bad = sorted(set(given) - known)
        if bad:
            raise SamplingError(f"unknown sampling setting(s) for {stage}: {', '.join(bad)}; known: "
                                f"{', '.join(sorted(known))}")
        base = DEFAULTS[stage] if temperature is None else replace(DEFAULTS[stage], temperature=temperature)
        stages[stage] = replace(base, **given)
    return Sampling(stages, float(threshold))


def recorded(sampling: Sampling) -> dict:
    """What a run's params.json records: every stage's settings in full, so a run says how it was sampled."""
    return {**{s: {**asdict(v), "stop": list(v.stop)} for s, v in sampling.stages.items()},
            "loop_threshold": sampling.loop_threshold}
