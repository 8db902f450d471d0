"""What a user asks of an article run, validated before anything starts."""

from dataclasses import asdict, dataclass, field
from pathlib import Path

from orchestrator.pipeline.sampling import Sampling, SamplingError, recorded, resolve


class ParamsError(ValueError):
    pass


def from_fields(cls, data: dict, what: str):
    """A params dataclass from a dict of its fields, refusing names it does not have (what: "article", ...)."""
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ParamsError(f"unknown {what} setting(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return cls(**data)


LENGTHS = {"short": (3, 120), "medium": (5, 200), "long": (8, 300)}  # sections, words per section


@dataclass
class ArticleParams:
    topic: str
    audience: str = "general readers"
    sections: int = 4
    words_per_section: int = 150
    images: int = 2
    sources: list[str] = field(default_factory=list)  # text or Markdown files that ground the research
    template: str = "sd15"  # a built-in ComfyUI template (sd15, sdxl, flux) or a path to one
    seed: int | None = None
    temperature: float = 0.7
    llm_url: str | None = None  # override SCRIPTORIUM_LLM_URL for this run
    comfyui_url: str | None = None  # override SCRIPTORIUM_COMFYUI_URL for this run
    model: str | None = None
    style: str | None = None  # how the sections are written ("plain and practical", "playful")
    # per-stage overrides of pipeline.sampling's defaults; stored in full once resolved
    sampling: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.topic, str) or not self.topic.strip():
            raise ParamsError("topic must be a non-empty string")
        self.topic = self.topic.strip()
        if not 1 <= self.sections <= 12:
            raise ParamsError(f"sections must be between 1 and 12, got {self.sections}")
        if not 30 <= self.words_per_section <= 2000:
            raise ParamsError(f"words_per_section must be between 30 and 2000, got {self.words_per_section}")
        if not 0 <= self.images <= self.sections:
            raise ParamsError(f"images must be between 0 and the number of sections ({self.sections}), got {self.images}")
        if not 0 <= self.temperature <= 2:
            raise ParamsError(f"temperature must be in [0, 2], got {self.temperature}")
        try:
            self.sampling = recorded(resolve(self.sampling, None if self.temperature == 0.7 else self.temperature))
        except SamplingError as e:
            raise ParamsError(str(e)) from None
        resolved = []
        for source in self.sources:
            path = Path(source).expanduser().resolve()
            if not path.is_file():
                raise ParamsError(f"source file {source} does not exist")
            resolved.append(str(path))
        self.sources = resolved

    @classmethod
    def from_dict(cls, data: dict) -> "ArticleParams":
        return from_fields(cls, data, "article")

    def stage_sampling(self) -> Sampling:
        return resolve(self.sampling)

    def to_dict(self) -> dict:
        return asdict(self)
