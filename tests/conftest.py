import os
from pathlib import Path

import pytest

# Tests never write to the user's data directory: a run-wide home unless the caller chose one (CI does).
os.environ.setdefault("SCRIPTORIUM_HOME", str(Path(__file__).resolve().parent.parent / ".home"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from backend.model_store import pull

    return pull("smollm2")
