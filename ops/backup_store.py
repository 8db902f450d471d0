"""The backup directory on disk: manifests read defensively, and the lock that create and prune share.

<root>/<id>/manifest.json lists a backup's files; <root>/objects/<sha256> holds model files shared by
backups; <root>/.<id>.partial is a backup being written; <root>/.lock is flocked by every create (shared)
and by prune (exclusive). A manifest is data from disk, not trusted: every entry must name a plain
relative path and, for objects, a bare sha256, or the backup is not used. Nothing below the root is reached
through a link: a backup id that is a link is listed as broken and never used, a manifest is read with
O_NOFOLLOW, and the lock is opened with O_NOFOLLOW|O_CREAT relative to the root's descriptor.
"""

import contextlib
import errno
import fcntl
import json
import os
import re
import sqlite3
import stat
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ops import backup_fs

MANIFEST = "manifest.json"
OBJECTS = "objects"
LOCK = ".lock"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_BACKUP_ID = re.compile(r"\d{8}-\d{6}-\d{3}")  # what create names them: 20260101-030000-000
_LOCK_OPEN = os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a fifo never blocks it


class BackupError(Exception):
    pass


def failure(e: Exception, root: Path, what: str) -> BackupError:
    """One line for the person: which path, what went wrong."""
    if isinstance(e, sqlite3.Error):
        return BackupError(f"cannot {what}: the job database could not be copied: {e}")
    filename = getattr(e, "filename", None)
    reason = getattr(e, "strerror", None) or str(e)
    if filename and not str(Path(filename).absolute()).startswith(str(root.absolute())):
        return BackupError(f"cannot {what}: cannot read {filename}: {reason}")
    return BackupError(f"cannot {what} to {root}: {reason}")


@dataclass
class Backup:
    id: str
    path: Path
    created: float
    files: list[dict]  # the entries that passed the checks
    problems: list[str] = field(default_factory=list)  # one line per entry that did not, naming it
    objects: set[str] = field(default_factory=set)  # every object name any entry refers to
    skipped: list[dict] = field(default_factory=list)  # what was not copied, with why (links, special files)

    @property
    def size(self) -> int:
        return sum(f["size"] for f in self.files)


@dataclass
class Broken:
    """A backup directory whose manifest cannot be read: shown, never used, never deleted by prune."""
    id: str
    path: Path
    problem: str


def is_object_name(name) -> bool:
    return isinstance(name, str) and _SHA256.fullmatch(name) is not None


def path_problem(path) -> str | None:
    """Why `path` may not be a manifest entry's path, or None. Only plain relative paths in canonical form
    ("runs/x/a.md"), so that every entry lands under the restore target and no two entries alias."""
    if not isinstance(path, str) or not path:
        return "the path is not a non-empty string"
    if "\0" in path:
        return "the path contains a NUL byte"
    if path.startswith("/"):
        return "the path is absolute"
    if ".." in path.split("/"):
        return "the path climbs out with '..'"
    if str(PurePosixPath(path)) != path or path == ".":
        return "the path is not in plain form (no '.', '//' or trailing '/')"
    return None


def entry_problem(entry) -> str | None:
    if not isinstance(entry, dict):
        return "the entry is not a JSON object"
    problem = path_problem(entry.get("path"))
    if problem:
        return problem
    if not is_object_name(entry.get("sha256")):
        return "sha256 is not 64 lowercase hex digits"
    size = entry.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return "size is not a non-negative integer"
    obj = entry.get("object")
    if obj is not None:
        if not is_object_name(obj):
            return "object is not a bare sha256 name (64 lowercase hex digits)"
        if obj != entry["sha256"]:
            return "object does not match its sha256"
    return None


def _name(entry) -> str:
    path = entry.get("path") if isinstance(entry, dict) else None
    return repr(path) if isinstance(path, str) else "(no path)"


def load(path: Path) -> Backup:
    """Read <path>/manifest.json. Raises ValueError or OSError when the manifest as a whole is unusable;
    problems of single entries are kept in Backup.problems."""
    with os.fdopen(backup_fs.open_file(path.parent, f"{path.name}/{MANIFEST}"), "rb") as f:
        data = json.loads(f.read().decode())
    if not isinstance(data, dict):
        raise ValueError("the manifest is not a JSON object")
    created, entries = data.get("created"), data.get("files")
    if not isinstance(created, (int, float)) or isinstance(created, bool):
        raise ValueError("'created' is missing or not a number")
    if not isinstance(entries, list):
        raise ValueError("'files' is missing or not a list")
    files, problems, objects, seen = [], [], set(), set()
    for i, entry in enumerate(entries):
        if isinstance(entry, dict) and is_object_name(entry.get("object")):
            objects.add(entry["object"])  # kept from the store even if the entry is otherwise bad
        problem = entry_problem(entry)
        if problem is None and entry["path"] in seen:
            problem = "the path is listed twice"
        if problem:
            problems.append(f"bad entry {_name(entry)} (#{i}): {problem}")
            continue
        seen.add(entry["path"])
        files.append(entry)
    for entry in files:  # a file may not also be a directory of another entry ("a" and "a/b")
        parents = {str(p) for p in PurePosixPath(entry["path"]).parents}
        if parents & seen:
            problems.append(f"bad entry {entry['path']!r}: a parent directory of it is listed as a file")
    # The directory name is the id: a manifest's own "id" could disagree with it or repeat another's.
    skipped = data.get("skipped")  # absent from backups made before links were skipped
    skipped = [s for s in skipped if isinstance(s, dict)] if isinstance(skipped, list) else []
    return Backup(path.name, path, float(created), files, problems, objects, skipped)


def scan(root: Path) -> tuple[list[Backup], list[Broken]]:
    """Every backup under root, oldest first, and the ones whose manifest cannot be read."""
    good: list[Backup] = []
    broken: list[Broken] = []
    if not root.is_dir():
        return good, broken
    for path in sorted(root.iterdir()):
        if path.name.startswith(".") or path.name == OBJECTS:
            continue
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            continue  # removed meanwhile
        if stat.S_ISLNK(mode) and _BACKUP_ID.fullmatch(path.name):
            broken.append(Broken(path.name, path, "a symbolic link, not followed (a backup is a directory)"))
        if not stat.S_ISDIR(mode):
            continue
        try:
            good.append(load(path))
        except FileNotFoundError:
            # Named like a backup, it lost its manifest; anything else (lost+found, a user's folder) is not ours.
            if _BACKUP_ID.fullmatch(path.name):
                broken.append(Broken(path.name, path, f"{MANIFEST} is missing"))
        except (OSError, ValueError, backup_fs.Unsafe) as e:  # JSONDecodeError, UnicodeDecodeError: ValueError
            broken.append(Broken(path.name, path, f"{MANIFEST} cannot be read: {e}"))
    return good, broken


def list_backups(root: Path) -> list[Backup]:
    return scan(root)[0]


@contextlib.contextmanager
def store_lock(root: Path, exclusive: bool, wait: bool = True, required: bool = True):
    """flock <root>/.lock: shared for create (and restore, verify), exclusive for prune. The kernel drops
    it when its process dies, so a crashed create never blocks prune. Yields whether the lock is held
    (False only when wait is False and it is busy, or required is False and the store is read-only)."""
    try:
        fd = _open_lock(root)
    except OSError as e:
        if not required and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT):
            yield False  # a read-only store: nobody prunes it under us from here
            return
        raise BackupError(f"cannot lock the backups in {root}: {e.strerror}") from None
    try:
        flags = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB)
        try:
            fcntl.flock(fd, flags)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _open_lock(root: Path) -> int:
    """<root>/.lock, made if missing, relative to the root's descriptor and never through a link: a link
    planted there is refused, naming it, so no file outside the backups is ever created or opened."""
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = os.open(LOCK, _LOCK_OPEN, 0o666, dir_fd=root_fd)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise BackupError(f"cannot lock the backups in {root}: {root / LOCK} is a symbolic link; "
                          "remove it (it is made anew)") from None
    finally:
        os.close(root_fd)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise BackupError(f"cannot lock the backups in {root}: {root / LOCK} is {backup_fs.kind(mode)}, "
                          "not a regular file; remove it (it is made anew)")
    return fd
