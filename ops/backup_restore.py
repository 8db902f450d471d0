"""Checking a backup and writing it back: regular files and directories only, never through a link.

verify re-hashes every stored file, read without following any link, and flags one that is a link, a special
file or has more than one hard link (another name, perhaps outside the backup, can change its bytes). restore
writes only when every entry verifies and every destination is a plain path under the target: no component
of it a link, nothing but a regular file where the file goes. Stored files are read from the backups root
down (objects/<sha256>, <id>/<path>), so a backup id or an objects folder that is a link is refused too, and
every write is made in a directory opened without following links and renamed relative to it.
"""

import contextlib
import os
from pathlib import Path

from ops import backup_fs
from ops.backup_store import MANIFEST, OBJECTS, Backup, BackupError, Broken, failure, store_lock


def _stored(root: Path, backup: Backup, entry: dict) -> tuple[Path, str]:
    """(base, path below it) of an entry's stored bytes: the shared object store or the backup's directory,
    both below the root, so that neither is followed if it is a link."""
    return root, f"{OBJECTS}/{entry['object']}" if entry.get("object") else f"{backup.id}/{entry['path']}"


def verify(root: Path, backup: Backup | Broken) -> list[str]:
    """Every file re-hashed; returns one line per bad entry, missing, unsafe, linked or corrupt file."""
    if isinstance(backup, Broken):
        return [f"broken: {backup.path / MANIFEST}: {backup.problem}"]
    problems = list(backup.problems)
    with store_lock(root, exclusive=False, required=False):
        for entry in backup.files:
            problem = _check(*_stored(root, backup, entry), entry)
            if problem:
                problems.append(problem)
    return problems


def _check(base: Path, relative: str, entry: dict) -> str | None:
    shown = base / relative
    try:
        fd = backup_fs.open_file(base, relative)
    except (FileNotFoundError, NotADirectoryError):
        return f"missing: {entry['path']} ({shown})"
    except backup_fs.Unsafe as e:
        return f"unsafe: {entry['path']} ({shown}): {e}; a backup holds only regular files"
    try:
        st = os.fstat(fd)
        if st.st_nlink > 1:
            return (f"linked: {entry['path']} ({shown}) has {st.st_nlink} hard links, so another name (perhaps "
                    "outside the backup) can change it; give it its own copy (cp it aside, then mv it back)")
        if st.st_size != entry["size"] or backup_fs.sha256_fd(fd) != entry["sha256"]:
            return f"corrupt: {entry['path']} ({shown}): checksum does not match the manifest"
    finally:
        os.close(fd)
    return None


def restore(root: Path, backup: Backup, target: Path, force: bool = False) -> list[Path]:
    """Write the backup's files under `target` (configs under target/configs); returns what was written.
    Nothing is written unless every entry verifies and lands inside target without passing a link."""
    try:
        with store_lock(root, exclusive=False, required=False):  # prune cannot delete it meanwhile
            return _restore(root, backup, target, force)
    except OSError as e:
        raise failure(e, target, "restore the backup") from None
    except backup_fs.Unsafe as e:  # a link swapped in after the checks: refused, never written through
        raise BackupError(f"cannot restore the backup to {target}: {e}") from None


def _restore(root: Path, backup: Backup, target: Path, force: bool) -> list[Path]:
    problems = verify(root, backup)
    if problems:
        raise BackupError("the backup does not verify, nothing was restored:\n" + "\n".join(problems))
    entries = [e for e in backup.files if not e["path"].startswith("docker/")]
    refused = [f"{e['path']} ({why})" for e in entries if (why := backup_fs.write_problem(target, e["path"]))]
    if refused:  # as tarfile's data filter does: a link under target could lead anywhere
        raise BackupError(f"restoring would go through a link or outside {target}, nothing was restored: "
                          + ", ".join(refused))
    existing = [target / e["path"] for e in entries if os.path.lexists(target / e["path"])]
    if existing and not force:
        shown = ", ".join(str(p) for p in existing[:5]) + (f" and {len(existing) - 5} more" if len(existing) > 5 else "")
        raise BackupError(f"restoring would overwrite {shown}; pass --force to replace them (or --to another dir)")
    target.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for entry in entries:
        written.append(_write(root, backup, entry, target, len(written)))
    return written


def _write(root: Path, backup: Backup, entry: dict, target: Path, done: int) -> Path:
    """One entry: into a temporary made beside it (in a directory opened without following links), then
    renamed over the destination, so readers see the old file or the whole new one."""
    *dirs, name = entry["path"].split("/")
    dir_fd = backup_fs.open_dirs(target, dirs, create=True)
    tmp = f".{name}.restoring"
    try:
        with contextlib.suppress(FileNotFoundError):  # left by a restore that died; unlink never follows a link
            os.unlink(tmp, dir_fd=dir_fd)
        source = backup_fs.open_file(*_stored(root, backup, entry))
        try:
            with backup_fs.new_file(tmp, dir_fd) as out:
                copied = backup_fs.copy_fd(source, out)
        finally:
            os.close(source)
        if copied["sha256"] != entry["sha256"]:
            raise BackupError(f"{entry['path']} changed in the backup while it was restored; "
                              f"{done} files were restored, run verify")
        if entry["path"] == "jobs.db":  # a stale write-ahead log must not be replayed onto the restored db
            for suffix in ("-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name + suffix, dir_fd=dir_fd)
        # Relative to the directory opened above: whatever its path has become meanwhile, never through a link.
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.fsync(dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    finally:
        os.close(dir_fd)
    return target.joinpath(*dirs, name)
