"""Writes that a crash cannot leave half done: the old file or the whole new one, never a torn one."""

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable (the directory entry is data too)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write data to path through a temporary file in the same directory: write, fsync, rename, fsync the
    directory. mode: the file's permissions, set before any byte is written (for secrets)."""
    atomic_write_chunks(path, [data], mode)


def atomic_write_chunks(path: Path, chunks: Iterable[bytes | memoryview], mode: int | None = None) -> None:
    """atomic_write_bytes for data made a piece at a time (gigabytes that are never one bytes object). The
    temporary file is made anew (O_EXCL): a link or FIFO planted at a guessable name is never written through."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str, mode: int | None = None) -> None:
    atomic_write_bytes(path, text.encode(), mode)
