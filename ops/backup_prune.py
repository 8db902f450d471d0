"""Retention: which backups to keep, and removing the rest along with the objects nothing uses any more."""

import os
import shutil
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from common.files import fsync_dir
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


def _prune(root: Path, keep_last: int, keep_daily: int, keep_weekly: int) -> Pruned:
    result = Pruned()
    backups, broken = scan(root)
    keep = prune_plan(backups, keep_last, keep_daily, keep_weekly)
    for b in backups:
        if b.id not in keep:
            # Hidden first (one rename), then deleted: a crash halfway never leaves a listed backup with holes.
            doomed = root / f".{b.id}.deleting"
            b.path.rename(doomed)
            shutil.rmtree(doomed)
            result.removed.append(b.id)
    for b in broken:
        result.notes.append(f"kept {b.id}: {b.problem}; fix or remove it by hand")
    for leftover in root.iterdir():  # under the exclusive lock no create runs: these are from crashes
        if leftover.name.startswith(".") and leftover.name.endswith((".partial", ".deleting")) and leftover.is_dir():
            shutil.rmtree(leftover)
    fsync_dir(root)
    objects = root / OBJECTS
    if not objects.is_dir():
        return result
    if broken:
        # A manifest that cannot be read may refer to any object, and what survives of its text cannot say
        # which (a truncated file lost the rest): deleting none is the only choice that loses no model.
        result.notes.append(f"kept every object in {objects}: the objects of {', '.join(b.id for b in broken)} "
                            "are unknown")
        return result
    used = set().union(*(b.objects for b in scan(root)[0]))
    for stored in objects.iterdir():
        if stored.name not in used:  # unused objects, and temporaries (.<sha>.*.partial) of crashed backups
            if stored.is_dir():
                shutil.rmtree(stored)
            else:
                os.unlink(stored)
            result.objects_removed += 1
    fsync_dir(objects)
    return result
