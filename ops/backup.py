"""Verified backups: every file checksummed in a manifest, visible only once complete, restorable.

A backup is a directory <root>/<id>/ with manifest.json and the files it lists. The job database
is copied with SQLite's online backup API, so a backup taken while jobs write is consistent.
Models (only with --include models) go to a content-addressed store <root>/objects/<sha256>
shared by every backup, so an unchanged file is never copied twice. Every file is fsynced before
the backup's directory is renamed into place, so a backup that is listed survives a power cut.
Nothing is read through a link, and links and special files are listed as skipped (ops/backup_fs.py).
"""

import hashlib
import json
import os
import shutil
import socket
import sqlite3
import stat
import tempfile
import time
from datetime import datetime
from pathlib import Path

from common.files import atomic_write_text, fsync_dir
from common.hashing import sha256_file
from ops import backup_fs
from ops.backup_prune import prune, prune_plan
from ops.backup_restore import restore, verify
from ops.backup_store import (
    MANIFEST,
    OBJECTS,
    Backup,
    BackupError,
    Broken,
    failure,
    list_backups,
    scan,
    store_lock,
)

__all__ = ["MANIFEST", "Backup", "BackupError", "Broken", "create", "find", "get", "list_backups", "prune",
           "prune_plan", "restore", "root_for", "scan", "sha256", "verify"]


sha256 = sha256_file  # the name backup's callers (verify, tests) use


def root_for(home: Path, to: str | None) -> Path:
    return Path(to).expanduser() if to else home / "backups"


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _sqlite_copy(source: Path, target: Path) -> None:
    src = sqlite3.connect(f"file:{source}?mode=ro", uri=True, timeout=30)
    dst = sqlite3.connect(target)
    try:
        src.backup(dst)  # page by page, restarting if a writer changes the database meanwhile
    finally:
        dst.close()
        src.close()
    _fsync_file(target)


def _store_object(objects: Path, source: int) -> dict:
    """Put a model file (an open descriptor) into the content-addressed store, once per distinct content."""
    digest = backup_fs.sha256_fd(source)
    if (objects / digest).exists():
        return {"sha256": digest, "size": os.fstat(source).st_size, "object": digest}
    fd, tmp = tempfile.mkstemp(dir=objects, prefix=f".{digest}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as dst:
            copied = backup_fs.copy_fd(source, dst)
        # Named by what was copied: if the file changed meanwhile, the name still matches the bytes stored.
        os.replace(tmp, objects / copied["sha256"])
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(objects)
    return {**copied, "object": copied["sha256"]}


def create(home: Path, root: Path, configs: list[Path], include_models: bool = False,
           docker_images: list[tuple[str, object]] | None = None) -> Backup:
    """Take a backup of the data directory under `root`; returns it once complete. On any failure the
    partial directory is removed and BackupError says what failed."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        with store_lock(root, exclusive=False):  # prune keeps every object while this backup is written
            return _create(home, root, configs, include_models, docker_images or [])
    except (OSError, sqlite3.Error) as e:
        raise failure(e, root, "write the backup") from None


def _create(home: Path, root: Path, configs: list[Path], include_models: bool,
            docker_images: list[tuple[str, object]]) -> Backup:
    backup_id = datetime.now().strftime("%Y%m%d-%H%M%S-%f")[:-3]
    partial = root / f".{backup_id}.partial"
    final = root / backup_id
    partial.mkdir()
    files: list[dict] = []
    dirs = {partial}

    def place(relative: str) -> Path:
        target = partial / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        dirs.update(p for p in target.parents if p.is_relative_to(partial))
        return target

    skipped: list[dict] = []

    def copy(base: Path, found: backup_fs.Found, store, entry: dict) -> None:
        """Copy one file, unless it is (or became, since the scan) a link or a special file, or has a hard link
        outside: then it is skipped with a note in the manifest."""
        try:
            fd = backup_fs.open_file(base, found.path)
        except backup_fs.Unsafe as e:
            skipped.append({**entry, "note": f"{e}: not copied"})
            return
        except (FileNotFoundError, NotADirectoryError):
            return  # gone: like a file that never was
        try:
            links = os.fstat(fd).st_nlink
            if links > found.links:
                skipped.append({**entry, "note": f"has {links} hard links, some outside: not copied"})
                return
            files.append({**entry, **store(fd)})
        finally:
            os.close(fd)

    def into_backup(relative: str):
        def store(fd: int) -> dict:
            with open(place(relative), "wb") as dst:
                return backup_fs.copy_fd(fd, dst)
        return store

    try:
        for config in configs:
            relative = f"configs/{config.name}"
            copy(config.parent, backup_fs.Found(config.name, 1), into_backup(relative),
                 {"path": relative, "source": str(config)})
        jobs = home / "jobs.db"
        st = jobs.lstat() if jobs.exists() or jobs.is_symlink() else None
        if st and not (stat.S_ISREG(st.st_mode) and st.st_nlink == 1):
            note = backup_fs.skip_note(st.st_mode) if not stat.S_ISREG(st.st_mode) else \
                f"has {st.st_nlink} hard links: not copied"
            skipped.append({"path": "jobs.db", "note": note})
        elif st:
            _sqlite_copy(jobs, place("jobs.db"))
            files.append({"path": "jobs.db", "sha256": sha256(partial / "jobs.db"),
                          "size": (partial / "jobs.db").stat().st_size})
        runs = backup_fs.scan(home, "runs", ignore=lambda name: name.endswith(".partial"))
        skipped += runs.skipped
        for found in runs.files:
            copy(home, found, into_backup(found.path), {"path": found.path})
        if include_models:
            models = backup_fs.scan(home, "models")
            skipped += models.skipped
            objects = root / OBJECTS
            objects.mkdir(exist_ok=True)
            for found in models.files:
                copy(home, found, lambda fd: _store_object(objects, fd), {"path": found.path})
        for service, image_stream in docker_images:
            files.append({"path": f"docker/{service}.tar", **_save_image(service, image_stream,
                                                                         place(f"docker/{service}.tar"))})
        manifest = {"id": backup_id, "created": time.time(), "host": socket.gethostname(), "home": str(home),
                    "include_models": include_models, "files": files, "skipped": skipped}
        atomic_write_text(partial / MANIFEST, json.dumps(manifest, indent=2))
        for directory in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            fsync_dir(directory)  # every entry is on disk before the backup becomes visible
        partial.rename(final)  # the backup appears only now, complete
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return Backup(backup_id, final, manifest["created"], files, skipped=skipped)


def _save_image(service: str, image_stream, target: Path) -> dict:
    digest, size = hashlib.sha256(), 0
    with open(target, "wb") as f:
        stream = iter(image_stream)
        while True:
            try:
                chunk = next(stream, None)
            except Exception as e:  # noqa: BLE001 the docker SDK's errors: name the container, not a traceback
                raise BackupError(f"cannot save {service}'s container image: {e}") from None
            if chunk is None:
                break
            f.write(chunk)  # the image is streamed to disk, never held in memory
            digest.update(chunk)
            size += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": digest.hexdigest(), "size": size}


def find(root: Path, backup_id: str | None) -> Backup | Broken:
    """The backup whose id starts with backup_id (default: the newest), readable or not."""
    good, broken = scan(root)
    every = sorted([*good, *broken], key=lambda b: b.id)
    if not every:
        raise BackupError(f"no backups in {root}")
    if backup_id is None:
        return every[-1]
    matches = [b for b in every if b.id.startswith(backup_id)]
    if len(matches) != 1:
        known = ", ".join(b.id for b in every[-5:])
        raise BackupError(f"no single backup {backup_id!r} in {root} ({len(matches)} match); recent: {known}")
    return matches[0]


def get(root: Path, backup_id: str | None) -> Backup:
    chosen = find(root, backup_id)
    if isinstance(chosen, Broken):
        raise BackupError(f"backup {chosen.id} cannot be used: {chosen.problem} ({chosen.path})")
    return chosen
