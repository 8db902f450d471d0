"""The job store's rows as Python values, and the columns that name the process working on a run."""

import hashlib
import json
import sqlite3
from dataclasses import dataclass

from common.procs import ProcessIdentity, live_identity


@dataclass
class Run:
    id: str
    kind: str
    params: dict
    status: str
    stage: str | None
    progress: float
    message: str | None
    error: str | None
    result: dict | None
    pid: int | None
    cancel_requested: bool
    created: float
    updated: float
    finished: float | None
    client: str | None = None
    queued_at: float | None = None
    queue_position: int | None = None  # 1 for the next job to start; None when it is not waiting (pool.py)
    pid_start: int | None = None  # the start time and boot of the process `pid` names (common.procs)
    pid_boot: str | None = None

    @property
    def worker_alive(self) -> bool:
        """Whether the very process recorded for it still runs: a pid that another process got since (the
        worker died) is not it. Rows recorded before start times were kept go by the pid alone."""
        return self.pid is not None and ProcessIdentity(self.pid, self.pid_start, self.pid_boot).alive()

    @property
    def interrupted(self) -> bool:
        """Marked running, but the process running it is gone: `resume` picks it up."""
        return self.status == "running" and not self.worker_alive

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["interrupted"] = self.interrupted
        return d


@dataclass
class Step:
    name: str
    status: str
    output: object
    error: str | None
    started: float | None
    finished: float | None
    files: dict | None = None  # None: recorded before hashes were (presence is all that can be checked)
    inputs: dict | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @property
    def digest(self) -> str:
        """What a consumer of this step depends on: its output and the content of its files."""
        return step_digest(self.output, self.files)


def worker_columns(pid: int | None) -> dict:
    """The columns that name a run's process: its pid with the start time and boot of the process that has it
    now. A pid whose process is gone (or a zombie) is recorded as no process, never as a bare pid that a later
    process could be taken for."""
    identity = live_identity(pid) if pid is not None else None
    if identity is None:
        return {"pid": None, "pid_start": None, "pid_boot": None}
    return {"pid": identity.pid, "pid_start": identity.start_time, "pid_boot": identity.boot}


def step_digest(output, files: dict | None) -> str:
    return hashlib.sha256(json.dumps([output, files], sort_keys=True).encode()).hexdigest()


def run_from(row: sqlite3.Row) -> Run:
    return Run(
        id=row["id"],
        kind=row["kind"],
        params=json.loads(row["params"]),
        status=row["status"],
        stage=row["stage"],
        progress=row["progress"],
        message=row["message"],
        error=row["error"],
        result=json.loads(row["result"]) if row["result"] else None,
        pid=row["pid"],
        cancel_requested=bool(row["cancel_requested"]),
        created=row["created"],
        updated=row["updated"],
        finished=row["finished"],
        client=row["client"],
        queued_at=row["queued_at"],
        pid_start=row["pid_start"],
        pid_boot=row["pid_boot"],
    )


def step_from(row: sqlite3.Row) -> Step:
    return Step(
        name=row["name"],
        status=row["status"],
        output=json.loads(row["output"]) if row["output"] else None,
        error=row["error"],
        started=row["started"],
        finished=row["finished"],
        files=json.loads(row["files"]) if row["files"] else None,
        inputs=json.loads(row["inputs"]) if row["inputs"] else None,
    )
