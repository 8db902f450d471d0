"""Where the stack keeps its files: one data directory, SCRIPTORIUM_HOME (default ~/.local/share/scriptorium)."""

import os
from pathlib import Path

HOME_VAR = "SCRIPTORIUM_HOME"
DEFAULT_HOME = "~/.local/share/scriptorium"


def data_home() -> Path:
    return Path(os.environ.get(HOME_VAR) or DEFAULT_HOME).expanduser()


def state_dir(home: Path | None = None) -> Path:
    return (home or data_home()) / "state"
