"""The agent config files `python -m mcp_server install` changed, recorded so `ops backup` can keep them
(and the `.scriptorium.bak` copies beside them) without knowing any client's layout."""

import json
from pathlib import Path

from common.files import atomic_write_text
from common.paths import state_dir

RECORD = "agent_configs.json"


def record_path(home: Path | None = None) -> Path:
    return state_dir(home) / RECORD


def remembered(home: Path | None = None) -> list[Path]:
    """The config files install has changed, in the order first changed; a damaged record reads as none."""
    try:
        data = json.loads(record_path(home).read_text())
        return [Path(p) for p in data.get("files", []) if isinstance(p, str)]
    except (OSError, ValueError, AttributeError):
        return []


def remember(path: Path, home: Path | None = None) -> None:
    files = remembered(home)
    if Path(path) not in files:
        files.append(Path(path))
        atomic_write_text(record_path(home), json.dumps({"files": [str(p) for p in files]}, indent=2) + "\n")


def backups_of(path: Path) -> list[Path]:
    """The copies install kept of `path` before it changed it."""
    return sorted(Path(path).parent.glob(f"{Path(path).name}.*.scriptorium.bak"))
