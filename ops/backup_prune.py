"""Retention: which backups to keep, and removing the rest along with the objects nothing uses any more.

Everything is deleted relative to descriptors of the root and of objects/, walking directories by
descriptor (backup_fs.remove_tree), so only entries proven inside the backups are removed: a link found
inside is removed itself, never followed. An objects folder that is a link stops prune before it removes
anything, naming it; a backup id that is a link is kept and noted like any broken backup.
"""

import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from ops import backup_fs
from ops.backup_store import OBJECTS, Backup, BackupError, scan, store_lock


@dataclass
class Pruned:
    removed: list[str] = field(default_factory=list)  # backup ids
    objects_removed: int = 0
    notes: list[str] = field(default_factory=list)  # what was kept that retention alone would not keep, and why


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
    return prune_report(root, keep_last, keep_daily, keep_weekly).removed


def prune_report(root: Path, keep_last: int, keep_daily: int, keep_weekly: int) -> Pruned:
    """Remove the backups retention does not keep, then unused objects and what crashed backups left.

    It runs under the store's exclusive lock, which every create, restore and verify holds shared while
    it runs: so no backup still being written (whose objects are stored before its manifest exists) can
    lose an object, and any .partial directory seen here belongs to a backup that died."""
    if not root.is_dir():
        return Pruned()
    try:
        with store_lock(root, exclusive=True, wait=False) as held:
            if not held:
                raise BackupError(f"a backup, restore or verify is running in {root} (it holds {root / '.lock'}); "
                                  "nothing was pruned: run prune again once it is done")
            return _prune(root, keep_last, keep_daily, keep_weekly)
    except OSError as e:
        raise BackupError(f"cannot prune the backups in {root}: {e.filename or root}: {e.strerror}") from None
    except backup_fs.Unsafe as e:
        raise BackupError(f"cannot prune the backups in {root}: {root}/{e}; nothing was pruned") from None


def _prune(root: Path, keep_last: int, keep_daily: int, keep_weekly: int) -> Pruned:
    root_fd = backup_fs.open_dirs(root, [])
    objects_fd = None
    try:
        if os.path.lexists(root / OBJECTS):  # opened before anything is removed: a link there stops prune
            objects_fd = backup_fs.open_dirs(root, [OBJECTS])
        return _remove(root, root_fd, objects_fd, keep_last, keep_daily, keep_weekly)
    finally:
        os.close(root_fd)
        if objects_fd is not None:
            os.close(objects_fd)


def _remove(root: Path, root_fd: int, objects_fd: int | None, keep_last: int, keep_daily: int,
            keep_weekly: int) -> Pruned:
    result = Pruned()
    backups, broken = scan(root)
    keep = prune_plan(backups, keep_last, keep_daily, keep_weekly)
    for b in backups:
        if b.id not in keep:
            # Hidden first (one rename), then deleted: a crash halfway never leaves a listed backup with holes.
            doomed = f".{b.id}.deleting"
            os.rename(b.id, doomed, src_dir_fd=root_fd, dst_dir_fd=root_fd)
            backup_fs.remove_tree(root_fd, doomed)
            result.removed.append(b.id)
    for b in broken:
        result.notes.append(f"kept {b.id}: {b.problem}; fix or remove it by hand")
    for name in os.listdir(root_fd):  # under the exclusive lock no create runs: these are from crashes
        if name.startswith(".") and name.endswith((".partial", ".deleting")):
            backup_fs.remove_tree(root_fd, name)
    os.fsync(root_fd)
    if objects_fd is None:
        return result
    if broken:
        # A manifest that cannot be read may refer to any object, and what survives of its text cannot say
        # which (a truncated file lost the rest): deleting none is the only choice that loses no model.
        result.notes.append(f"kept every object in {root / OBJECTS}: the objects of "
                            f"{', '.join(b.id for b in broken)} are unknown")
        return result
    used = set().union(*(b.objects for b in scan(root)[0]))
    for name in os.listdir(objects_fd):
        if name not in used:  # unused objects, and temporaries (.<sha>.*.partial) of crashed backups
            backup_fs.remove_tree(objects_fd, name)
            result.objects_removed += 1
    os.fsync(objects_fd)
    return result
