"""Where the backend keeps its files: everything lives under SCRIPTORIUM_HOME (common.paths)."""

from pathlib import Path

from common.paths import data_home


def models_dir() -> Path:
    return data_home() / "models"


def cache_dir() -> Path:
    return data_home() / "cache"
