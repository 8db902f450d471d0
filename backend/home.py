"""Where the backend keeps its files: everything lives under SCRIPTORIUM_HOME."""

import os
from pathlib import Path


def data_home() -> Path:
    return Path(os.environ.get("SCRIPTORIUM_HOME") or Path.home() / ".local/share/scriptorium").expanduser()


def models_dir() -> Path:
    return data_home() / "models"


def cache_dir() -> Path:
    return data_home() / "cache"
