"""Verified backups: every file checksummed in a manifest, visible only once complete, restorable.

A backup is a directory <root>/<id>/ with manifest.json and the files it lists. The job database
is copied with SQLite's online backup API, so a backup taken while jobs write is consistent.
Models (only with --include models) go to a content-addressed store <root>/objects/<sha256>
shared by every backup, so an unchanged file is never copied twice.
"""

import hashlib
import json
import os
import shutil
import socket
import sqlite3
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

MANIFEST = "manifest.json"


class BackupError(Exception):
    pass


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class Backup:
    id: str
    path: Path
    created: float
    files: list[dict]

    @property
    def size(self) -> int:
        return sum(f["size"] for f in self.files)


def root_for(home: Path, to: str | None) -> Path:
    return Path(to).expanduser() if to else home / "backups"


def _copy(source: Path, target: Path) -> dict:
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, target)
    return {"sha256": sha256(target), "size": target.stat().st_size}


def _sqlite_copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    src = sqlite3.connect(f"file:{source}?mode=ro", uri=True, timeout=30)
    dst = sqlite3.connect(target)
    try:
        src.backup(dst)  # page by page, restarting if a writer changes the database meanwhile
    finally:
        dst.close()
        src.close()


def create(home: Path, root: Path, configs: list[Path], include_models: bool = False,
           docker_images: list[tuple[str, object]] | None = None) -> Backup:
    """Take a backup of the data directory under `root`; returns it once complete."""
    backup_id = datetime.now().strftime("%Y%m%d-%H%M%S-%f")[:-3]
    partial = root / f".{backup_id}.partial"
    final = root / backup_id
    partial.mkdir(parents=True)
    files: list[dict] = []
    try:
        for config in configs:
            if config.is_file():
                files.append({"path": f"configs/{config.name}", "source": str(config),
                              **_copy(config, partial / "configs" / config.name)})
        jobs = home / "jobs.db"
        if jobs.exists():
            _sqlite_copy(jobs, partial / "jobs.db")
            files.append({"path": "jobs.db", "sha256": sha256(partial / "jobs.db"),
                          "size": (partial / "jobs.db").stat().st_size})
        runs = home / "runs"
        if runs.is_dir():
            for path in sorted(p for p in runs.rglob("*") if p.is_file() and not p.name.endswith(".partial")):
                relative = path.relative_to(home)
                files.append({"path": str(relative), **_copy(path, partial / relative)})
        if include_models and (home / "models").is_dir():
            objects = root / "objects"
            objects.mkdir(exist_ok=True)
            for path in sorted(p for p in (home / "models").rglob("*") if p.is_file()):
                digest = sha256(path)
                stored = objects / digest
                if not stored.exists():  # content-addressed: each distinct file is stored once
                    tmp = objects / f".{digest}.partial"
                    shutil.copy2(path, tmp)
                    tmp.replace(stored)
                files.append({"path": str(path.relative_to(home)), "sha256": digest, "size": path.stat().st_size,
                              "object": digest})
        for service, image_stream in docker_images or []:
            target = partial / "docker" / f"{service}.tar"
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as f:
                for chunk in image_stream:  # the image is streamed to disk, never held in memory
                    f.write(chunk)
            files.append({"path": f"docker/{service}.tar", "sha256": sha256(target), "size": target.stat().st_size})
        manifest = {"id": backup_id, "created": time.time(), "host": socket.gethostname(), "home": str(home),
                    "include_models": include_models, "files": files}
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=2))
        partial.rename(final)  # the backup appears only now, complete
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return Backup(backup_id, final, manifest["created"], files)


def list_backups(root: Path) -> list[Backup]:
    backups = []
    if not root.is_dir():
        return backups
    for path in sorted(root.iterdir()):
        manifest = path / MANIFEST
        if path.is_dir() and not path.name.startswith(".") and manifest.is_file():
            data = json.loads(manifest.read_text())
            backups.append(Backup(data["id"], path, data["created"], data["files"]))
    return backups


def get(root: Path, backup_id: str | None) -> Backup:
    backups = list_backups(root)
    if not backups:
        raise BackupError(f"no backups in {root}")
    if backup_id is None:
        return backups[-1]
    matches = [b for b in backups if b.id.startswith(backup_id)]
    if len(matches) != 1:
        known = ", ".join(b.id for b in backups[-5:])
        raise BackupError(f"no single backup {backup_id!r} in {root} ({len(matches)} match); recent: {known}")
    return matches[0]


def _stored(root: Path, backup: Backup, entry: dict) -> Path:
    return root / "objects" / entry["object"] if entry.get("object") else backup.path / entry["path"]


def verify(root: Path, backup: Backup) -> list[str]:
    """Every file re-hashed; returns one line per missing or corrupt file."""
    problems = []
    for entry in backup.files:
        path = _stored(root, backup, entry)
        if not path.is_file():
            problems.append(f"missing: {entry['path']} ({path})")
        elif path.stat().st_size != entry["size"] or sha256(path) != entry["sha256"]:
            problems.append(f"corrupt: {entry['path']} ({path}): checksum does not match the manifest")
    return problems


def restore(root: Path, backup: Backup, target: Path, force: bool = False) -> list[Path]:
    """Write the backup's files under `target` (configs under target/configs); returns what was written."""
    problems = verify(root, backup)
    if problems:
        raise BackupError("the backup does not verify, nothing was restored:\n" + "\n".join(problems))
    entries = [e for e in backup.files if not e["path"].startswith("docker/")]
    existing = [target / e["path"] for e in entries if (target / e["path"]).exists()]
    if existing and not force:
        shown = ", ".join(str(p) for p in existing[:5]) + (f" and {len(existing) - 5} more" if len(existing) > 5 else "")
        raise BackupError(f"restoring would overwrite {shown}; pass --force to replace them (or --to another dir)")
    written = []
    for entry in entries:
        destination = target / entry["path"]
        destination.parent.mkdir(parents=True, exist_ok=True)
        tmp = destination.with_name(f".{destination.name}.restoring")
        shutil.copy2(_stored(root, backup, entry), tmp)
        for suffix in ("-wal", "-shm"):  # a stale write-ahead log must not be replayed onto the restored db
            if entry["path"] == "jobs.db":
                Path(str(destination) + suffix).unlink(missing_ok=True)
        os.replace(tmp, destination)  # atomic: readers see the old file or the whole new one
        written.append(destination)
    return written


def prune_plan(backups: list[Backup], keep_last: int, keep_daily: int, keep_weekly: int) -> set[str]:
    """The ids to keep: the newest keep_last; the newest of each of the last keep_daily days that have a
    backup; the newest of each of the last keep_weekly ISO weeks that have one."""
    newest_first = sorted(backups, key=lambda b: b.created, reverse=True)
    keep = {b.id for b in newest_first[:keep_last]}
    for count, key in ((keep_daily, lambda t: t.strftime("%Y-%m-%d")),
                       (keep_weekly, lambda t: "{}-W{:02d}".format(*t.isocalendar()[:2]))):
        seen = []
        for b in newest_first:
            bucket = key(datetime.fromtimestamp(b.created))
            if bucket not in seen:
                if len(seen) == count:
                    break
                seen.append(bucket)
                keep.add(b.id)
    return keep


def prune(root: Path, keep_last: int, keep_daily: int, keep_weekly: int) -> list[str]:
    backups = list_backups(root)
    keep = prune_plan(backups, keep_last, keep_daily, keep_weekly)
    removed = []
    for b in backups:
        if b.id not in keep:
            shutil.rmtree(b.path)
            removed.append(b.id)
    used = {e["object"] for b in list_backups(root) for e in b.files if e.get("object")}
    objects = root / "objects"
    if objects.is_dir():
        for stored in objects.iterdir():
            if stored.name not in used:
                stored.unlink()
    return removed
