"""Where the orchestrator's upstreams and files are: environment variables, overridable per call."""

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

DEFAULT_LLM_URL = "http://127.0.0.1:8000/v1"


def _home() -> Path:
    return Path(os.environ.get("SCRIPTORIUM_HOME") or Path.home() / ".local/share/scriptorium").expanduser()


@dataclass(frozen=True)
class Settings:
    home: Path = field(default_factory=_home)
    llm_urls: tuple[str, ...] = (DEFAULT_LLM_URL,)
    llm_model: str | None = None  # None: the first model the upstream lists
    llm_api_key: str | None = None
    comfyui_url: str | None = None  # None: no images (pipelines say so)
    llm_structured_output: bool = True  # ask for JSON via response_format (off for upstreams without it)
    llm_timeout: float = 600.0
    comfyui_timeout: float = 900.0

    @classmethod
    def from_env(cls, **overrides) -> "Settings":
        env = os.environ
        urls = tuple(u.strip().rstrip("/") for u in env.get("SCRIPTORIUM_LLM_URL", DEFAULT_LLM_URL).split(",")
                     if u.strip())
        settings = cls(
            home=_home(),
            llm_urls=urls or (DEFAULT_LLM_URL,),
            llm_model=env.get("SCRIPTORIUM_LLM_MODEL") or None,
            llm_api_key=env.get("SCRIPTORIUM_LLM_API_KEY") or None,
            comfyui_url=(env.get("SCRIPTORIUM_COMFYUI_URL") or "").rstrip("/") or None,
            llm_structured_output=env.get("SCRIPTORIUM_LLM_STRUCTURED_OUTPUT", "1").lower() not in ("0", "false", "no"),
        )
        return replace(settings, **{k: v for k, v in overrides.items() if v is not None})

    @property
    def runs_dir(self) -> Path:
        return self.home / "runs"

    @property
    def jobs_db(self) -> Path:
        return self.home / "jobs.db"

    @property
    def logs_dir(self) -> Path:
        return self.home / "logs"
