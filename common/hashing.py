"""sha256 of files and bytes, as the backup manifests and the run records store them."""

import hashlib
from pathlib import Path

CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fingerprint(data: bytes) -> dict:
    """{"sha256", "size"} of some bytes: what a run records of each file it wrote."""
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
