"""Verified backups: every file checksummed in a manifest, visible only once complete, restorable.

A backup is a directory <root>/<id>/ with manifest.json and the files it lists. The job database
is copied with SQLite's online backup API, so a backup taken while jobs write is consistent.
Models (only with --include models) go to a content-addressed store <root>/objects/<sha256>
shared by every backup, so an unchanged file is never copied twice. Every file is fsynced before
the backup's directory is renamed into place, so a backup that is listed survives a power cut.
"""

import hashlib
import json
import os
import shutil
import socket
import sqlite3
import tempfile
import time
from datetime import datetime
from pathlib import Path

from common.files import atomic_write_text, fsync_dir
from common.hashing import sha256_file
from ops.backup_prune import prune, prune_plan
from ops.backup_store import MANIFEST, OBJECTS, Backup, BackupError, Broken, list_backups, scan, store_lock

__all__ = ["MANIFEST", "Backup", "BackupError", "Broken", "create", "find", "get", "list_backups", "prune",
           "prune_plan", "restore", "root_for", "scan", "sha256", "verify"]


sha256 = sha256_file  # the name backup's callers (verify, tests) use


def root_for(home: Path, to: str | None) -> Path:
    return Path(to).expanduser() if to else home / "backups"


def copy_hashed(source: Path, target: Path) -> dict:
    """Copy source to target, hashing the bytes as they are written, and fsync it; keeps the mtime."""
    digest, size = hashlib.sha256(), 0
    with open(source, "rb") as src, open(target, "wb") as dst:
        for chunk in iter(lambda: src.read(1 << 20), b""):
            dst.write(chunk)
            digest.update(chunk)
            size += len(chunk)
        dst.flush()
        os.fsync(dst.fileno())
    shutil.copystat(source, target)
    return {"sha256": digest.hexdigest(), "size": size}


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


def _store_object(objects: Path, path: Path) -> dict:
    """Put a model file into the content-addressed store (once per distinct content)."""
    digest = sha256(path)
    if (objects / digest).exists():
        return {"sha256": digest, "size": path.stat().st_size, "object": digest}
    fd, tmp = tempfile.mkstemp(dir=objects, prefix=f".{digest}.", suffix=".partial")
    os.close(fd)
    try:
        copied = copy_hashed(path, Path(tmp))
        # Named by what was copied: if the file changed meanwhile, the name still matches the bytes stored.
        os.replace(tmp, objects / copied["sha256"])
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(objects)
    return {**copied, "object": copied["sha256"]}


def _failure(e: Exception, root: Path, what: str) -> BackupError:
    """One line for the person: which path, what went wrong."""
    if isinstance(e, sqlite3.Error):
        return BackupError(f"cannot {what}: the job database could not be copied: {e}")
    filename = getattr(e, "filename", None)
    reason = getattr(e, "strerror", None) or str(e)
    if filename and not str(Path(filename).absolute()).startswith(str(root.absolute())):
        return BackupError(f"cannot {what}: cannot read {filename}: {reason}")
    return BackupError(f"cannot {what} to {root}: {reason}")


def create(home: Path, root: Path, configs: list[Path], include_models: bool = False,
           docker_images: list[tuple[str, object]] | None = None) -> Backup:
    """Take a backup of the data directory under `root`; returns it once complete. On any failure the
    partial directory is removed and BackupError says what failed."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        with store_lock(root, exclusive=False):  # prune keeps every object while this backup is written
            return _create(home, root, configs, include_models, docker_images or [])
    except (OSError, sqlite3.Error) as e:
        raise _failure(e, root, "write the backup") from None


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

    try:
        for config in configs:
            if config.is_file():
                files.append({"path": f"configs/{config.name}", "source": str(config),
                              **copy_hashed(config, place(f"configs/{config.name}"))})
        jobs = home / "jobs.db"
        if jobs.exists():
            _sqlite_copy(jobs, place("jobs.db"))
            files.append({"path": "jobs.db", "sha256": sha256(partial / "jobs.db"),
                          "size": (partial / "jobs.db").stat().st_size})
        runs = home / "runs"
        if runs.is_dir():
            for path in sorted(p for p in runs.rglob("*") if p.is_file() and not p.name.endswith(".partial")):
                relative = str(path.relative_to(home))
                files.append({"path": relative, **copy_hashed(path, place(relative))})
        if include_models and (home / "models").is_dir():
            objects = root / OBJECTS
            objects.mkdir(exist_ok=True)
            for path in sorted(p for p in (home / "models").rglob("*") if p.is_file()):
                files.append({"path": str(path.relative_to(home)), **_store_object(objects, path)})
        for service, image_stream in docker_images:
            files.append({"path": f"docker/{service}.tar", **_save_image(service, image_stream,
                                                                         place(f"docker/{service}.tar"))})
        manifest = {"id": backup_id, "created": time.time(), "host": socket.gethostname(), "home": str(home),
                    "include_models": include_models, "files": files}
        atomic_write_text(partial / MANIFEST, json.dumps(manifest, indent=2))
        for directory in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            fsync_dir(directory)  # every entry is on disk before the backup becomes visible
        partial.rename(final)  # the backup appears only now, complete
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return Backup(backup_id, final, manifest["created"], files)


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


def _stored(root: Path, backup: Backup, entry: dict) -> Path:
    return root / OBJECTS / entry["object"] if entry.get("object") else backup.path / entry["path"]


def _inside(path: Path, directory: Path) -> bool:
    return path.resolve().is_relative_to(directory.resolve())


def verify(root: Path, backup: Backup | Broken) -> list[str]:
    """Every file re-hashed; returns one line per bad entry, missing or corrupt file."""
    if isinstance(backup, Broken):
        return [f"broken: {backup.path / MANIFEST}: {backup.problem}"]
    problems = list(backup.problems)
    with store_lock(root, exclusive=False, required=False):
        for entry in backup.files:
            path = _stored(root, backup, entry)
            home = root / OBJECTS if entry.get("object") else backup.path
            if not path.is_file():
                problems.append(f"missing: {entry['path']} ({path})")
            elif not _inside(path, home):
                problems.append(f"unsafe: {entry['path']} ({path}) leads outside {home}")
            elif path.stat().st_size != entry["size"] or sha256(path) != entry["sha256"]:
                problems.append(f"corrupt: {entry['path']} ({path}): checksum does not match the manifest")
    return problems


def restore(root: Path, backup: Backup, target: Path, force: bool = False) -> list[Path]:
    """Write the backup's files under `target` (configs under target/configs); returns what was written.
    Nothing is written unless every entry verifies and lands inside target."""
    try:
        with store_lock(root, exclusive=False, required=False):  # prune cannot delete it meanwhile
            return _restore(root, backup, target, force)
    except OSError as e:
        raise _failure(e, target, "restore the backup") from None


def _restore(root: Path, backup: Backup, target: Path, force: bool) -> list[Path]:
    problems = verify(root, backup)
    if problems:
        raise BackupError("the backup does not verify, nothing was restored:\n" + "\n".join(problems))
    entries = [e for e in backup.files if not e["path"].startswith("docker/")]
    outside = [f"{e['path']} ({(target / e['path']).resolve()})" for e in entries
               if not _inside(target / e["path"], target)]
    if outside:  # through a symlink under target: refuse, as tarfile's data filter does
        raise BackupError(f"restoring would write outside {target}, nothing was restored: " + ", ".join(outside))
    existing = [target / e["path"] for e in entries if (target / e["path"]).exists()]
    if existing and not force:
        shown = ", ".join(str(p) for p in existing[:5]) + (f" and {len(existing) - 5} more" if len(existing) > 5 else "")
        raise BackupError(f"restoring would overwrite {shown}; pass --force to replace them (or --to another dir)")
    written = []
    for entry in entries:
        destination = target / entry["path"]
        destination.parent.mkdir(parents=True, exist_ok=True)
        tmp = destination.with_name(f".{destination.name}.restoring")
        try:
            if copy_hashed(_stored(root, backup, entry), tmp)["sha256"] != entry["sha256"]:
                raise BackupError(f"{entry['path']} changed in the backup while it was restored; "
                                  f"{len(written)} files were restored, run verify")
            if entry["path"] == "jobs.db":  # a stale write-ahead log must not be replayed onto the restored db
                for suffix in ("-wal", "-shm"):
                    Path(str(destination) + suffix).unlink(missing_ok=True)
            os.replace(tmp, destination)  # atomic: readers see the old file or the whole new one
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(destination.parent)
        written.append(destination)
    return written
