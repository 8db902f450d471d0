"""What ops started, under $SCRIPTORIUM_HOME/state: one JSON file per service."""

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from common.files import atomic_write_text
from common.procs import ProcessIdentity, boot_id, cmdline, pid_alive, start_time

__all__ = ["Record", "State", "now", "pid_alive", "boot_id", "same_process", "identify"]

NOT_SERVICES = {"lease.json"}


@dataclass
class Record:
    service: str
    runner: str  # process | docker
    pid: int | None = None
    container: str | None = None
    command: list[str] | None = None
    health: str | None = None
    log: str | None = None
    started: float = 0.0
    gpu_memory_measured: int | None = None  # bytes the service really took when it became healthy
    start_time: int | None = None  # the pid's start time (clock ticks since boot); None in files from before
    boot: str | None = None  # the kernel's boot id when it started: start times count from that boot

    @classmethod
    def from_dict(cls, data: dict) -> "Record":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def _runs(command: list[str], running: list[str]) -> bool:
    """Whether `running` (a /proc cmdline) is `command`. A script started through its #! line shows the
    interpreter first and its own path where argv[0] was, so the tail and argv[0]'s base name decide."""
    if running == command:
        return True
    n = len(command)
    if not command or len(running) < n:
        return False
    return running[len(running) - n + 1:] == command[1:] and \
        os.path.basename(running[len(running) - n]) == os.path.basename(command[0])


def same_process(record: Record) -> bool:
    """Whether the recorded pid still is the process ops started, so it may be signalled.

    The start time decides where it was recorded (an exec keeps it, so a service that re-executes itself
    stays known); the boot id guards against a new boot handing out the same pid at the same tick. Records
    from before start times were kept fall back to the command line: if it does not match, the pid was
    reused and the service is gone."""
    if not record.pid or not pid_alive(record.pid):
        return False
    if record.boot and boot_id() not in (record.boot, None):
        return False
    if record.start_time is not None:
        return ProcessIdentity(record.pid, record.start_time).alive()
    running = cmdline(record.pid)
    if running is None:  # no /proc to ask: the pid alone is all there is
        return True
    return bool(record.command) and _runs([str(c) for c in record.command], running)


def identify(record: Record) -> Record:
    """Fill in the identity of the process just started under record.pid."""
    if record.pid:
        record.start_time = start_time(record.pid)
        record.boot = boot_id()
    return record


class State:
    def __init__(self, home: Path):
        self.dir = home / "state"
        self.logs = home / "logs"

    def path(self, service: str) -> Path:
        return self.dir / f"{service}.json"

    def _load(self, path: Path) -> Record | None:
        """A record, or None (with a warning) when the file cannot be read: one damaged file must not stop
        ops from managing the other services. It is treated as gone, so nothing is ever signalled on its word."""
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            return Record.from_dict(data)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as e:
            print(f"warning: ignoring the unreadable state file {path}: {e}", file=sys.stderr)
            return None

    def get(self, service: str) -> Record | None:
        return self._load(self.path(service))

    def all(self) -> list[Record]:
        if not self.dir.exists():
            return []
        # lease.json (ops/lease_repair.py) shares the directory but is not a service
        paths = [p for p in sorted(self.dir.glob("*.json")) if p.name not in NOT_SERVICES]
        return [r for p in paths if (r := self._load(p)) is not None]

    def put(self, record: Record) -> None:
        atomic_write_text(self.path(record.service), json.dumps(asdict(record), indent=2))

    def remove(self, service: str) -> None:
        self.path(service).unlink(missing_ok=True)


def now() -> float:
    return time.time()
