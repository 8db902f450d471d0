"""What ops started, under $SCRIPTORIUM_HOME/state: one JSON file per service."""

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from common.procs import pid_alive

__all__ = ["Record", "State", "now", "pid_alive"]


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


class State:
    def __init__(self, home: Path):
        self.dir = home / "state"
        self.logs = home / "logs"

    def path(self, service: str) -> Path:
        return self.dir / f"{service}.json"

    def get(self, service: str) -> Record | None:
        path = self.path(service)
        if not path.exists():
            return None
        return Record(**json.loads(path.read_text()))

    def all(self) -> list[Record]:
        if not self.dir.exists():
            return []
        return [Record(**json.loads(p.read_text())) for p in sorted(self.dir.glob("*.json"))]

    def put(self, record: Record) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path(record.service).with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(record), indent=2))
        tmp.replace(self.path(record.service))

    def remove(self, service: str) -> None:
        self.path(service).unlink(missing_ok=True)


def now() -> float:
    return time.time()
