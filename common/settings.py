"""The project's settings: environment variables over an optional TOML file over defaults.

The file is $SCRIPTORIUM_CONFIG, else $SCRIPTORIUM_HOME/config.toml. Its keys are the field names
below (llm_urls may be a list or a comma-separated string). The orchestrator, the MCP server and ops
read them; the backend reads only SCRIPTORIUM_HOME, so it can run on its own.
"""

import os
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from common.paths import data_home

# How a backend is put to sleep and woken (ops' stack file and the orchestrator's settings both name one).
SLEEP_APIS = ("scriptorium", "vllm", "sglang", "none")

DEFAULT_LLM_URL = "http://127.0.0.1:8000/v1"
ENV = {  # field -> environment variable
    "llm_urls": "SCRIPTORIUM_LLM_URL",
    "llm_model": "SCRIPTORIUM_LLM_MODEL",
    "llm_api_key": "SCRIPTORIUM_LLM_API_KEY",
    "comfyui_url": "SCRIPTORIUM_COMFYUI_URL",
    "llm_structured_output": "SCRIPTORIUM_LLM_STRUCTURED_OUTPUT",
    "llm_sleep_api": "SCRIPTORIUM_LLM_SLEEP_API",
    "llm_timeout": "SCRIPTORIUM_LLM_TIMEOUT",
    "llm_backoff": "SCRIPTORIUM_LLM_BACKOFF",
    "comfyui_timeout": "SCRIPTORIUM_COMFYUI_TIMEOUT",
    "mcp_token": "SCRIPTORIUM_MCP_TOKEN",
    "mcp_budget": "SCRIPTORIUM_MCP_BUDGET",
    "mcp_allowed_dirs": "SCRIPTORIUM_MCP_ALLOWED_DIRS",
    "mcp_allowed_hosts": "SCRIPTORIUM_MCP_ALLOWED_HOSTS",
    "mcp_allowed_origins": "SCRIPTORIUM_MCP_ALLOWED_ORIGINS",
    "mcp_public_url": "SCRIPTORIUM_MCP_PUBLIC_URL",
    "mcp_toolsets": "SCRIPTORIUM_MCP_TOOLSETS",
    "leases": "SCRIPTORIUM_LEASES",
    "lease_idle": "SCRIPTORIUM_LEASE_IDLE",
    "lease_drain_timeout": "SCRIPTORIUM_LEASE_DRAIN_TIMEOUT",
    "lease_memory_timeout": "SCRIPTORIUM_LEASE_MEMORY_TIMEOUT",
    "max_jobs": "SCRIPTORIUM_MAX_JOBS",
    "max_queued_per_client": "SCRIPTORIUM_MAX_QUEUED_PER_CLIENT",
}


class SettingsError(ValueError):
    pass


def _home() -> Path:
    return data_home()


def default_max_jobs() -> int:
    """Job workers mostly wait on the LLM (which batches their requests), so one per core, at least 2, at most 16."""
    return max(2, min(16, os.cpu_count() or 2))


@dataclass(frozen=True)
class Settings:
    home: Path = field(default_factory=_home)
    llm_urls: tuple[str, ...] = (DEFAULT_LLM_URL,)
    llm_model: str | None = None  # None: the first model the upstream lists
    llm_api_key: str | None = None
    comfyui_url: str | None = None  # None: no images (pipelines say so)
    llm_structured_output: bool = True  # ask for JSON via response_format (off for upstreams without it)
    # How the LLM lends its memory for an image job: auto (ask it) | scriptorium | vllm | sglang | none
    llm_sleep_api: str = "auto"
    llm_timeout: float = 600.0
    llm_backoff: float = 5.0  # seconds a failing upstream is left out (doubling per failure in a row, up to 16x)
    comfyui_timeout: float = 900.0
    mcp_token: str | None = None  # required when the MCP server binds beyond localhost
    mcp_budget: float = 45.0  # seconds an MCP call may block before it returns a job id
    # Directories whose files MCP tools may read (os.pathsep-separated in the environment); None: stdio may read
    # the working directory, HTTP nothing. A client's MCP roots take their place (over HTTP: narrow them).
    mcp_allowed_dirs: tuple[str, ...] | None = None
    # Host and Origin headers the MCP HTTP server accepts beyond localhost's (DNS-rebinding protection stays on).
    mcp_allowed_hosts: tuple[str, ...] = ()
    mcp_allowed_origins: tuple[str, ...] = ()
    mcp_public_url: str | None = None  # the MCP endpoint as clients reach it (behind a TLS proxy: https://...)
    # The MCP tools listed (mcp_server/toolsets.py checks the names): core, team, images, all.
    mcp_toolsets: tuple[str, ...] = ("core",)
    leases: bool = True  # sleep the LLM to lend its GPU memory to an image job that would not fit
    lease_idle: float = 30.0  # seconds ComfyUI stays idle before the card goes back to the LLM
    lease_drain_timeout: float = 120.0  # longest wait for the LLM's requests in flight to finish
    lease_memory_timeout: float = 60.0  # longest wait for the freed memory to show on the card
    max_jobs: int = field(default_factory=default_max_jobs)  # article, stage and image jobs running at once; more wait
    max_queued_per_client: int = 20  # jobs one client (its MCP clientInfo name, or "cli") may have waiting

    @classmethod
    def from_env(cls, **overrides) -> "Settings":
        home = _home()
        values: dict = {"home": home}
        path = Path(os.environ.get("SCRIPTORIUM_CONFIG") or home / "config.toml").expanduser()
        if path.is_file():
            try:
                data = tomllib.loads(path.read_text())
            except tomllib.TOMLDecodeError as e:
                raise SettingsError(f"{path} is not valid TOML: {e}") from None
            known = {f.name for f in fields(cls)} - {"home"}
            unknown = sorted(set(data) - known)
            if unknown:
                raise SettingsError(f"{path}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
            values.update({k: _coerce(k, v, str(path)) for k, v in data.items()})
        for name, var in ENV.items():
            if os.environ.get(var) not in (None, ""):
                values[name] = _coerce(name, os.environ[var], var)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return replace(cls(), **values)

    @property
    def runs_dir(self) -> Path:
        return self.home / "runs"

    @property
    def jobs_db(self) -> Path:
        return self.home / "jobs.db"

    @property
    def logs_dir(self) -> Path:
        return self.home / "logs"


def _coerce(name: str, value, source: str):
    try:
        if name == "llm_urls":
            urls = value.split(",") if isinstance(value, str) else list(value)
            urls = tuple(str(u).strip().rstrip("/") for u in urls if str(u).strip())
            if not urls:
                raise ValueError("no URL given")
            return urls
        if name in ("llm_structured_output", "leases"):
            return value if isinstance(value, bool) else str(value).lower() not in ("0", "false", "no", "off")
        if name in ("llm_timeout", "llm_backoff", "comfyui_timeout", "mcp_budget", "lease_idle", "lease_drain_timeout",
                    "lease_memory_timeout"):
            number = float(value)
            if number < 0 or (number == 0 and name not in ("lease_idle",)):
                raise ValueError("must be positive")
            return number
        if name in ("max_jobs", "max_queued_per_client"):
            number = int(value)
            if number < (1 if name == "max_jobs" else 0):
                raise ValueError("must be at least 1" if name == "max_jobs" else "must not be negative")
            return number
        if name == "mcp_allowed_dirs":
            dirs = value.split(os.pathsep) if isinstance(value, str) else list(value)
            return tuple(str(d).strip() for d in dirs if str(d).strip())
        if name in ("mcp_allowed_hosts", "mcp_allowed_origins", "mcp_toolsets"):
            items = value.split(",") if isinstance(value, str) else list(value)
            return tuple(str(i).strip().rstrip("/") for i in items if str(i).strip())
        if name == "mcp_public_url":
            url = str(value).strip().rstrip("/")
            if not url.startswith(("http://", "https://")):
                raise ValueError("must be an http:// or https:// URL, such as https://scriptorium.example.org/mcp")
            return url
        if name == "llm_sleep_api":
            api = str(value).strip().lower()
            if api not in ("auto", *SLEEP_APIS):
                raise ValueError(f"must be one of auto, {', '.join(SLEEP_APIS)}")
            return api
        if name == "comfyui_url":
            return str(value).rstrip("/") or None
        return str(value)
    except (TypeError, ValueError) as e:
        raise SettingsError(f"{source}: {name} = {value!r} is not usable ({e})") from None
