"""Verified backups: every file checksummed in a manifest, visible only once complete, restorable.

A backup is a directory <root>/<id>/ with manifest.json and the files it lists. The job database
is copied with SQLite's online backup API, so a backup taken while jobs write is consistent.
Models (only with --include models) go to a content-addressed store <root>/objects/<sha256>
shared by every backup, so an unchanged file is never copied twice. Every file is fsynced before
the backup's directory is renamed into place, so a backup that is listed survives a power cut.
Nothing is read through a link, and links and special files are listed as skipped (ops/backup_fs.py).
"""

import contextlib
import hashlib
import json
import os
import secrets
import socket
import sqlite3
import stat
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import BinaryIO

from common.hashing import sha256_file
from ops import backup_database, backup_fs
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


@dataclass
class _Partial:
    """The backup being written, <root>/.<id>.partial: every directory opened from the root down without
    following a link, every file made anew (O_EXCL|O_NOFOLLOW), so a link swapped into the tree meanwhile
    fails the backup instead of sending a write outside."""

    root: Path
    name: str
    dirs: set[str] = field(default_factory=lambda: {""})  # made so far, "" for the partial directory itself

    def open_dir(self, relative: str, create: bool = False) -> int:
        try:
            return backup_fs.open_dirs(self.root, [self.name, *filter(None, relative.split("/"))], create)
        except backup_fs.Unsafe as e:
            raise BackupError(f"the backup being written in {self.root} was changed under it: {e}") from None

    def new_file(self, relative: str) -> BinaryIO:
        directory, _, name = relative.rpartition("/")
        dir_fd = self.open_dir(directory, create=True)
        try:
            parts = directory.split("/") if directory else []
            self.dirs.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
            return backup_fs.new_file(name, dir_fd)
        finally:
            os.close(dir_fd)

    def write_manifest(self, text: str) -> None:
        """Written beside its final name, fsynced, then renamed into it relative to the directory's fd."""
        with self.new_file(f".{MANIFEST}.tmp") as f:
            f.write(text.encode())
            f.flush()
            os.fsync(f.fileno())
        dir_fd = self.open_dir("")
        try:
            os.replace(f".{MANIFEST}.tmp", MANIFEST, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        finally:
            os.close(dir_fd)

    def sync_dirs(self) -> None:
        for directory in sorted(self.dirs, key=lambda d: d.count("/") + bool(d), reverse=True):
            dir_fd = self.open_dir(directory)
            try:
                os.fsync(dir_fd)  # every entry is on disk before the backup becomes visible
            finally:
                os.close(dir_fd)


def _store_object(objects_fd: int, source: int) -> dict:
    """Put a model file (an open descriptor) into the content-addressed store, once per distinct content."""
    digest = backup_fs.sha256_fd(source)
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISREG(os.stat(digest, dir_fd=objects_fd, follow_symlinks=False).st_mode):
            return {"sha256": digest, "size": os.fstat(source).st_size, "object": digest}
    tmp = f".{digest}.{secrets.token_hex(4)}.partial"
    try:
        with backup_fs.new_file(tmp, objects_fd) as dst:
            copied = backup_fs.copy_fd(source, dst)
        # Named by what was copied: if the file changed meanwhile, the name still matches the bytes stored.
        # A link at that name is replaced itself, never written through.
        os.replace(tmp, copied["sha256"], src_dir_fd=objects_fd, dst_dir_fd=objects_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=objects_fd)
        raise
    os.fsync(objects_fd)
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
    except backup_fs.Unsafe as e:  # a link where the store has a directory (objects/): never followed
        raise BackupError(f"cannot write the backup to {root}: {root}/{e}; remove or move it") from None


def _create(home: Path, root: Path, configs: list[Path], include_models: bool,
            docker_images: list[tuple[str, object]]) -> Backup:
    backup_id = datetime.now().strftime("%Y%m%d-%H%M%S-%f")[:-3]
    partial = _Partial(root, f".{backup_id}.partial")
    root_fd = backup_fs.open_dirs(root, [])
    try:
        os.mkdir(partial.name, dir_fd=root_fd)
        try:
            manifest = _fill(home, root, partial, backup_id, configs, include_models, docker_images)
            partial.sync_dirs()
            # The backup appears only now, complete.
            os.rename(partial.name, backup_id, src_dir_fd=root_fd, dst_dir_fd=root_fd)
            os.fsync(root_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                backup_fs.remove_tree(root_fd, partial.name)
            raise
    finally:
        os.close(root_fd)
    return Backup(backup_id, root / backup_id, manifest["created"], manifest["files"],
                  skipped=manifest["skipped"])


def _fill(home: Path, root: Path, partial: _Partial, backup_id: str, configs: list[Path],
          include_models: bool, docker_images: list[tuple[str, object]]) -> dict:
    """Copy everything into the partial backup and write its manifest; returns the manifest."""
    files: list[dict] = []
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
        except backup_fs.Unsafe as e:  # the job database, replaced after it was opened
            skipped.append({**entry, "note": f"{e}: not copied"})
        finally:
            os.close(fd)

    def into_backup(relative: str):
        def store(fd: int) -> dict:
            with partial.new_file(relative) as dst:
                return backup_fs.copy_fd(fd, dst)
        return store

    def database(fd: int) -> dict:
        with backup_database.snapshot(fd, "jobs.db") as copied:
            return into_backup("jobs.db")(copied)

    for config in configs:
        relative = f"configs/{config.name}"
        copy(config.parent, backup_fs.Found(config.name, 1), into_backup(relative),
             {"path": relative, "source": str(config)})
    copy(home, backup_fs.Found("jobs.db", 1), database, {"path": "jobs.db"})
    runs = backup_fs.scan(home, "runs", ignore=lambda name: name.endswith(".partial"))
    skipped += runs.skipped
    for found in runs.files:
        copy(home, found, into_backup(found.path), {"path": found.path})
    if include_models:
        models = backup_fs.scan(home, "models")
        skipped += models.skipped
        objects_fd = backup_fs.open_dirs(root, [OBJECTS], create=True)
        try:
            for found in models.files:
                copy(home, found, lambda fd: _store_object(objects_fd, fd), {"path": found.path})
        finally:
            os.close(objects_fd)
    for service, image_stream in docker_images:
        with partial.new_file(f"docker/{service}.tar") as out:
            files.append({"path": f"docker/{service}.tar", **_save_image(service, image_stream, out)})
    manifest = {"id": backup_id, "created": time.time(), "host": socket.gethostname(), "home": str(home),
                "include_models": include_models, "files": files, "skipped": skipped}
    partial.write_manifest(json.dumps(manifest, indent=2))
    return manifest


def _save_image(service: str, image_stream, f: BinaryIO) -> dict:
    digest, size = hashlib.sha256(), 0
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
