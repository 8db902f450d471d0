"""How the agents' own CLIs are started against this server, shared by tests/backend/test_agent_clis.py and
bench/agent_prompts.py: the environment that turns off their telemetry, error reports and update checks, and a
Codex home whose model provider is the server."""

import os
from pathlib import Path

import pytest

CLIS = Path(__file__).resolve().parents[2] / ".tools" / "npm" / "bin"  # where `make tools` installs them
QUIET = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "NO_COLOR": "1",
}


def cli(name: str) -> Path:
    """The installed CLI, or the test skipped."""
    path = CLIS / name
    if not path.exists():
        pytest.skip(f"the {name} CLI is not installed: `make tools` installs it (needs npm)")
    return path


def environment(home: Path, env: dict) -> dict:
    """A CLI's whole environment: PATH, home, QUIET and env."""
    return {"PATH": os.environ["PATH"], "HOME": str(home), **QUIET, **env}


def codex_home(home: Path, url: str, **provider: int) -> Path:
    """home/.codex with a config.toml whose provider is the server at url; provider: more integer settings of
    that provider (stream_idle_timeout_ms, stream_max_retries, ...)."""
    codex = home / ".codex"
    codex.mkdir(parents=True, exist_ok=True)
    extra = "".join(f"{key} = {value}\n" for key, value in provider.items())
    (codex / "config.toml").write_text(
        'model = "smollm2"\nmodel_provider = "scriptorium"\ncheck_for_update_on_startup = false\n'
        "[analytics]\nenabled = false\n"
        '[model_providers.scriptorium]\nname = "Scriptorium"\n'
        f'base_url = "{url}/v1"\nwire_api = "responses"\nenv_key = "SCRIPTORIUM_API_KEY"\n{extra}'
    )
    return codex
