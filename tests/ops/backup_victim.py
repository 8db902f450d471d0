"""A folder outside the backups that links planted in them point at, and what it takes to see it changed."""

import hashlib
import json
import os
import stat
from pathlib import Path

MARKER = b"victim's bytes: outside every backup tree\n"
OLD_ID = "20200101-000000-000"  # named like a backup, older than any a test makes


def everything(directory: Path) -> dict[str, tuple]:
    """Every entry under directory and the directory itself, links not followed: its kind, its bytes (a file)
    or target (a link), its mtime and mode. Any name, byte or mtime changed shows."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(directory):
        for path in [Path(dirpath), *(Path(dirpath) / name for name in dirnames + filenames)]:
            st = path.lstat()
            content = (
                path.read_bytes()
                if stat.S_ISREG(st.st_mode)
                else os.readlink(path)
                if stat.S_ISLNK(st.st_mode)
                else None
            )
            found[str(path.relative_to(directory))] = (
                stat.S_IFMT(st.st_mode),
                content,
                st.st_mtime_ns,
                stat.S_IMODE(st.st_mode),
            )
    return found


def leaks(directory: Path, marker: bytes = MARKER) -> list[str]:
    """The regular files under directory (links not followed) that hold the marker."""
    if not directory.exists():
        return []
    return [
        path
        for path, (kind, content, _, _) in everything(directory).items()
        if kind == stat.S_IFREG and marker in content
    ]


def make_victim(directory: Path) -> Path:
    """Files worth keeping, a folder, a file named like a stored object, and a manifest that makes the folder
    look like a backup whose one file checks out: every way the backup code could mistake it for its own."""
    (directory / "sub").mkdir(parents=True)
    (directory / "notes.txt").write_bytes(MARKER)
    (directory / "sub" / "deep.txt").write_bytes(MARKER + b"deep\n")
    (directory / hashlib.sha256(MARKER).hexdigest()).write_bytes(MARKER)
    entry = {"path": "notes.txt", "sha256": hashlib.sha256(MARKER).hexdigest(), "size": len(MARKER)}
    (directory / "manifest.json").write_text(
        json.dumps({"id": OLD_ID, "created": 1577836800.0, "files": [entry]})
    )
    return directory
