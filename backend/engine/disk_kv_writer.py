"""The disk prefix cache's background thread: it writes the blocks the engine hands over, marks entries used on a
hit, and keeps everything under the cache's root within its size, least recently used out.

The engine thread never waits on it: put() and touch() queue work, and put() refuses (the blocks are simply not
kept) once the queued copies would hold more than PENDING_LIMIT bytes of memory. The thread starts with the first
piece of work and ends when it has had none for IDLE seconds, so an engine that never finishes a prompt holds no
thread. At exit the queued writes are finished (atexit), within EXIT_WAIT seconds.
"""

import atexit
import contextlib
import logging
import os
import stat
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.quant import pack_file

log = logging.getLogger(__name__)
PENDING_LIMIT = 1 << 30
IDLE = 5.0
EXIT_WAIT = 60.0
LOW_WATER = 0.9  # an eviction removes entries until the cache holds at most this share of its size


@dataclass
class Job:
    path: Path
    made_from: dict | None = None  # None: only mark the entry used
    tensors: dict[str, torch.Tensor] | None = None
    nbytes: int = 0
    done: Callable[[bool], None] | None = None  # told whether the entry was written


class DiskWriter:
    def __init__(self, root: Path, max_bytes: int, removed: Callable[[Path], None]):
        self.root = root
        self.max_bytes = max_bytes
        self.removed = removed  # told of each entry evicted
        self.jobs: deque[Job] = deque()
        self.pending_bytes = 0
        self.busy = False
        self.total: int | None = None  # bytes under root, counted by the thread when it first runs
        self.thread: threading.Thread | None = None
        self.cond = threading.Condition()
        self.warned = False
        _writers.add(self)

    def put(self, job: Job) -> bool:
        """Queue a write; False (nothing queued) when the queue already holds PENDING_LIMIT bytes."""
        with self.cond:
            if self.pending_bytes + job.nbytes > PENDING_LIMIT:
                return False
            self.pending_bytes += job.nbytes
            self._queue(job)
        return True

    def room(self) -> int:
        """Bytes put() takes before it refuses."""
        with self.cond:
            return PENDING_LIMIT - self.pending_bytes

    def touch(self, path: Path) -> None:
        with self.cond:
            self._queue(Job(path))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued job is done; False if timeout seconds passed first."""
        with self.cond:
            return self.cond.wait_for(lambda: not self.jobs and not self.busy, timeout)

    def _queue(self, job: Job) -> None:
        self.jobs.append(job)
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="disk-prefix-cache", daemon=True)
            self.thread.start()
        self.cond.notify_all()

    def _run(self) -> None:
        while True:
            with self.cond:
                self.busy = False
                self.cond.notify_all()
                if not self.cond.wait_for(lambda: self.jobs, IDLE):
                    self.thread = None
                    return
                job = self.jobs.popleft()
                self.busy = True
            try:
                self._do(job)
            except Exception as e:  # noqa: BLE001 a cache that cannot be written never fails the engine
                self._warn(f"disk prefix cache: {job.path} not written: {type(e).__name__}: {e}")
                if job.done is not None:
                    job.done(False)
            finally:
                with self.cond:
                    self.pending_bytes -= job.nbytes

    def _do(self, job: Job) -> None:
        if job.made_from is None:
            with contextlib.suppress(OSError):  # evicted meanwhile, or not ours to touch
                os.utime(job.path, follow_symlinks=False)
            return
        if self.total is None:
            self.total = sum(size for _, size, _ in _entries(self.root))
        if job.nbytes > self.max_bytes * LOW_WATER:
            job.done(False)
            return
        pack_file.write(job.path, pack_file.Entry(job.made_from, {}, job.tensors))
        self.total += os.lstat(job.path).st_size
        job.done(True)
        if self.total > self.max_bytes:
            self._evict()

    def _evict(self) -> None:
        """Remove the least recently used entries (of every model's setup under root, other processes' too: the
        directory is counted afresh) until at most LOW_WATER of the size is held."""
        entries = sorted(_entries(self.root))
        total = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if total <= self.max_bytes * LOW_WATER:
                break
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            total -= size
            self.removed(path)
        self.total = total

    def _warn(self, message: str) -> None:
        if (
            not self.warned
        ):  # one line per engine: a full or read-only disk would say the same for every block
            self.warned = True
            log.warning("%s (further failures are not reported)", message)


def _entries(root: Path) -> list[tuple[int, int, Path]]:
    """(modification time, size, path) of every file one level below root, links and all, never followed."""
    found = []
    try:
        setups = list(os.scandir(root))
    except OSError:
        return found
    for setup in setups:
        if not setup.is_dir(follow_symlinks=False):
            continue
        try:
            with os.scandir(setup.path) as files:
                for f in files:
                    try:
                        info = f.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    size = info.st_size if stat.S_ISREG(info.st_mode) else 0
                    found.append((info.st_mtime_ns, size, Path(f.path)))
        except OSError:
            continue
    return found


_writers: "weakref.WeakSet[DiskWriter]" = weakref.WeakSet()


@atexit.register
def finish_writes(timeout: float = EXIT_WAIT) -> None:
    """Wait (up to timeout seconds in all) for every engine's queued writes: at exit, and before a test empties
    the cache."""
    deadline = time.monotonic() + timeout
    for writer in list(_writers):
        writer.flush(max(deadline - time.monotonic(), 0))
