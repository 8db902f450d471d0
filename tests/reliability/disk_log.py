"""What reached the disk and in which order, for tests of atomic, durable writes."""

import os
from pathlib import Path


class DiskLog:
    """What reached the disk and in which order: fsyncs (by the path the descriptor had) and renames (by full
    path, also when made relative to directory descriptors)."""

    def __init__(self, monkeypatch):
        self.events: list[tuple] = []
        real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

        def fsync(fd):
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")))
            return real_fsync(fd)

        def named(path, dir_fd) -> str:
            return str(path) if dir_fd is None else os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)

        def replace(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
            self.events.append(("rename", named(src, src_dir_fd), named(dst, dst_dir_fd)))
            return real_replace(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

        def rename(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
            self.events.append(("rename", named(src, src_dir_fd), named(dst, dst_dir_fd)))
            return real_rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

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
