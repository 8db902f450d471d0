"""One line for a job database that cannot be opened or written: which file, and why (a full disk, a read-only or
foreign data directory), instead of SQLite's bare "disk I/O error" or "unable to open database file"."""

import errno
import os
import shutil
from pathlib import Path

# Below this much free space a failed write is the disk being full: SQLite reports a full tmpfs or ext4 as
# "disk I/O error" as often as "database or disk is full" (its 32 KiB shared-memory file cannot be grown).
NEARLY_FULL = 64 << 10


def free_bytes(path: Path) -> int | None:
    """Free bytes on the file system holding `path` (its nearest existing parent), None when it cannot be asked."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def writable(path: Path) -> bool:
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    return existing is not None and os.access(existing, os.W_OK)


def describe(db_path: Path, error: BaseException) -> str:
    """What went wrong with the job database, for one line on stderr or one MCP error."""
    home = db_path.parent
    text = str(error) or type(error).__name__
    if not writable(home) or "readonly" in text or "read-only" in text:
        return (f"{home} is not writable (read-only file system or permissions): the job database "
                f"{db_path.name} cannot be opened; make it writable or set SCRIPTORIUM_HOME to another directory")
    free = free_bytes(home)
    if "full" in text or getattr(error, "errno", None) == errno.ENOSPC or (free is not None and free < NEARLY_FULL):
        left = f"{free:,} bytes free" if free is not None else "no space left"
        return (f"the disk holding {home} is full ({left}): the job database {db_path.name} cannot be written; "
                "free some space and try again (nothing was changed)")
    return f"the job database {db_path} cannot be used: {text}"
