"""What reached the disk and in which order, for tests of atomic, durable writes."""

import os
from pathlib import Path


class DiskLog:
    """What reached the disk and in which order: fsyncs (by the path the descriptor had) and renames."""

    def __init__(self, monkeypatch):
        self.events: list[tuple] = []
        real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

        def fsync(fd):
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")))
            return real_fsync(fd)

        def replace(src, dst, *args, **kwargs):
            self.events.append(("rename", str(src), str(dst)))
            return real_replace(src, dst, *args, **kwargs)

        def rename(src, dst, *args, **kwargs):
            self.events.append(("rename", str(src), str(dst)))
            return real_rename(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(os, "rename", rename)

    def index(self, *event) -> int:
        return self.events.index(event)

    def renamed_to(self, dst: Path) -> int:
        return next(i for i, e in enumerate(self.events) if e[0] == "rename" and e[2] == str(dst))

    def synced_before_rename(self, dst: Path) -> bool:
        """dst came from a temporary that was fsynced, then renamed, then its directory fsynced."""
        i = self.renamed_to(dst)
        src = self.events[i][1]
        return ("fsync", src) in self.events[:i] and ("fsync", str(dst.parent)) in self.events[i:]
