"""The job database's copy for a backup: SQLite's online backup API, reading the file that was checked.

SQLite opens a database by name, so checking jobs.db and then connecting to its path would copy whatever a
link swapped in between points at. Instead the file is opened first, without following a link
(ops/backup_fs.py), and SQLite is given /proc/self/fd/N. SQLite resolves that to the name the opened file has,
so it reads the database's own -wal beside it, and never the target of a link planted at jobs.db after the
check. SQLite then says which file it opened (PRAGMA database_list): unless that is the checked file under the
name it had when checked, nothing is copied. The copy is written in a private temporary directory, so none of
SQLite's writes (the copy, its journal) goes by path into the backup tree; the caller copies it in through
descriptors.
"""

import contextlib
import os
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ops.backup_fs import Unsafe


def _name(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")  # the kernel's current name for the open file


def _replaced(shown: str) -> Unsafe:
    return Unsafe(f"{shown} was moved, removed or replaced (by a link?) while it was backed up")


def _is_checked_file(opened: str, fd: int) -> bool:
    try:
        return os.path.samestat(os.stat(opened, follow_symlinks=False), os.fstat(fd))
    except OSError:
        return False


@contextlib.contextmanager
def snapshot(fd: int, shown: str) -> Iterator[int]:
    """A consistent copy of the SQLite database open as `fd` (a checked regular file, shown as `shown`),
    taken while writers go on; yields a descriptor for reading the copy. Unsafe if SQLite would read any
    other file."""
    name = _name(fd)
    if not _is_checked_file(name, fd):
        raise _replaced(shown)
    with tempfile.TemporaryDirectory(prefix="scriptorium-backup-") as private:
        copy = Path(private) / "jobs.db"
        try:
            source = sqlite3.connect(f"file:/proc/self/fd/{fd}?mode=ro", uri=True, timeout=30)
        except sqlite3.Error:
            if not _is_checked_file(name, fd):  # the name was taken meanwhile: SQLite found no file by it
                raise _replaced(shown) from None
            raise
        try:
            opened = source.execute("PRAGMA database_list").fetchone()[2]
            if opened != name or not _is_checked_file(opened, fd):
                raise _replaced(shown)
            target = sqlite3.connect(copy)
            try:
                source.backup(target)  # page by page, restarting if a writer changes the database meanwhile
            finally:
                target.close()
        finally:
            source.close()
        copied = os.open(copy, os.O_RDONLY | os.O_CLOEXEC)
        try:
            yield copied
        finally:
            os.close(copied)
