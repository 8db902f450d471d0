"""Processes named by more than a pid: a recorded pid may belong to someone else once its process is gone.

A process is identified by its pid and its start time (field 22 of /proc/PID/stat, in clock ticks since
boot), which the kernel never reuses for a live pid, and by the boot it ran in (a file that outlives a reboot may
name a pid that the new boot hands out at the same tick); the command line is kept to say what it was.
"""

import os
from dataclasses import dataclass


def pid_alive(pid: int | None) -> bool:
    """Whether a process with this pid exists and is not a zombie (exited, not yet reaped)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[-1][:1] != "Z"
    except OSError:
        return True


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None when it is gone (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[-1].split()
    except OSError:
        return None
    return int(fields[19])  # field 22 overall; fields[0] is field 3 (the state)


def boot_id() -> str | None:
    """This boot's id (the kernel draws a new one at each boot), or None without /proc."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def cmdline(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    start_time: int | None  # None where /proc cannot tell (then the pid alone decides)
    boot: str | None = None  # the boot it ran in; None: not recorded (the start time alone decides)

    @classmethod
    def of(cls, pid: int) -> "ProcessIdentity":
        return cls(pid, start_time(pid), boot_id())

    def alive(self) -> bool:
        """Whether this very process still runs: same pid, same start time, same boot, not a zombie. A pid
        now held by another process reads as gone, so it is never signalled by mistake."""
        if not pid_alive(self.pid):
            return False
        if self.boot is not None and boot_id() not in (self.boot, None):
            return False
        if self.start_time is None:
            return True
        return start_time(self.pid) in (self.start_time, None)


def live_identity(pid: int) -> ProcessIdentity | None:
    """The identity of the process that has this pid now, to be recorded with it; None when there is none
    (gone, or a zombie), so that a pid is never recorded without the process it meant."""
    identity = ProcessIdentity.of(pid)
    return identity if identity.alive() else None
