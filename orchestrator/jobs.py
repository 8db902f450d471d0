"""Runs and their steps in SQLite, so a job outlives the process that started it."""

import hashlib
import json
import sqlite3
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from common.procs import pid_alive

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    params TEXT NOT NULL,
    status TEXT NOT NULL,           -- queued | running | done | failed | cancelled; open: a shared run
    stage TEXT,
    progress REAL NOT NULL DEFAULT 0,
    message TEXT,
    error TEXT,
    result TEXT,
    pid INTEGER,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    finished REAL
);
CREATE TABLE IF NOT EXISTS steps (
    run_id TEXT NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    name TEXT NOT NULL,
    status TEXT NOT NULL,           -- running | done | failed | skipped
    output TEXT,
    error TEXT,
    started REAL,
    finished REAL,
    files TEXT,                     -- {relative path: {sha256, size}} of what the step wrote
    inputs TEXT,                    -- {step name: digest} of the steps it consumed, when it finished
    PRIMARY KEY (run_id, name)
);
CREATE TABLE IF NOT EXISTS history (
    run_id TEXT NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    part TEXT NOT NULL,             -- the step that holds the part: research, write:00, illustrate:01, assemble
    version INTEGER NOT NULL,
    client TEXT NOT NULL,           -- who changed it (an MCP client's name, the CLI, the pipeline)
    tool TEXT NOT NULL,             -- and with what
    at REAL NOT NULL,
    digest TEXT NOT NULL,           -- the step's digest after the change
    content TEXT,                   -- an outline's JSON or a section's text: no version is ever lost
    note TEXT,                      -- the instructions or prompt it was made with
    PRIMARY KEY (run_id, part, version)
);
"""
SCHEMA_VERSION = 2  # 1: steps without files/inputs (their outputs are checked for presence only)
STEP_COLUMNS = {"files": "TEXT", "inputs": "TEXT"}

ACTIVE = ("queued", "running")


class JobError(Exception):
    pass


class UnknownRun(JobError):
    """No run has the id asked for."""


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

    @property
    def worker_alive(self) -> bool:
        return self.pid is not None and pid_alive(self.pid)

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


def step_digest(output, files: dict | None) -> str:
    return hashlib.sha256(json.dumps([output, files], sort_keys=True).encode()).hexdigest()


class JobStore:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            db.executescript(SCHEMA)
            _migrate(db)

    @contextmanager
    def _connect(self):
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            # FULL, not WAL's usual NORMAL: NORMAL may lose the last commits on a power cut, and a run id
            # already handed to an agent or a cancel already acknowledged would vanish. A run makes tens of
            # commits, each next to an LLM call or a render, so an fsync per commit costs nothing visible.
            db.execute("PRAGMA synchronous=FULL")
            db.execute("PRAGMA foreign_keys=ON")
            db.execute("PRAGMA busy_timeout=30000")
            db.row_factory = sqlite3.Row
            yield db
        finally:
            db.close()

    @contextmanager
    def transaction(self):
        """A connection inside BEGIN IMMEDIATE: what is read in it cannot change before it commits."""
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    # Runs ----------------------------------------------------------------------------------------------

    def create_run(self, kind: str, params: dict, status: str = "queued") -> Run:
        now = time.time()
        run_id = time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + "-" + uuid.uuid4().hex[:6]
        with self._connect() as db:
            db.execute("INSERT INTO runs (id, kind, params, status, created, updated) VALUES (?, ?, ?, ?, ?, ?)",
                       (run_id, kind, json.dumps(params), status, now, now))
        return self.get(run_id)

    def get(self, run_id: str) -> Run:
        with self._connect() as db:
            row = db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
            if row is None and run_id:  # allow a unique prefix, as people type ids from `list`
                # substr, not LIKE: '%' and '_' in what was typed are characters, not wildcards
                rows = db.execute("SELECT * FROM runs WHERE substr(id, 1, ?) = ?", (len(run_id), run_id)).fetchall()
                if len(rows) == 1:
                    row = rows[0]
                elif len(rows) > 1:
                    raise JobError(f"run id {run_id!r} is ambiguous: {', '.join(r['id'] for r in rows[:5])}")
        if row is None:
            raise UnknownRun(f"no run {run_id!r}; `python -m orchestrator list` shows the runs")
        return _run(row)

    def recent(self, limit: int = 50) -> list[Run]:
        with self._connect() as db:
            rows = db.execute("SELECT * FROM runs ORDER BY created DESC LIMIT ?", (limit,)).fetchall()
        return [_run(r) for r in rows]

    def page(self, limit: int, before: tuple[float, str] | None = None) -> list[Run]:
        """Runs newest first, starting after `before` (the created time and id of the last one already seen)."""
        with self._connect() as db:
            if before is None:
                rows = db.execute("SELECT * FROM runs ORDER BY created DESC, id DESC LIMIT ?", (limit,)).fetchall()
            else:
                rows = db.execute("SELECT * FROM runs WHERE created < ? OR (created = ? AND id < ?) "
                                  "ORDER BY created DESC, id DESC LIMIT ?",
                                  (before[0], before[0], before[1], limit)).fetchall()
        return [_run(r) for r in rows]

    def update(self, run_id: str, **fields) -> None:
        for key in ("result", "params"):
            if key in fields and fields[key] is not None:
                fields[key] = json.dumps(fields[key])
        fields["updated"] = time.time()
        if fields.get("status") in ("done", "failed", "cancelled"):
            fields["finished"] = fields["updated"]
        columns = ", ".join(f"{k} = ?" for k in fields)
        with self._connect() as db:
            db.execute(f"UPDATE runs SET {columns} WHERE id = ?", (*fields.values(), run_id))

    def claim(self, run_id: str, pid: int) -> Run:
        """Mark a run as being worked on by this process; refuse if another live process has it."""
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            row = db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
            if row is None:
                db.execute("ROLLBACK")
                raise JobError(f"no run {run_id!r}")
            run = _run(row)
            if run.status in ("done", "cancelled"):
                db.execute("ROLLBACK")
                raise JobError(f"run {run_id} is {run.status}; nothing to resume")
            if run.pid is not None and run.pid != pid and run.worker_alive and run.status == "running":
                db.execute("ROLLBACK")
                raise JobError(f"run {run_id} is being worked on by process {run.pid}")
            db.execute("UPDATE runs SET status = 'running', pid = ?, error = NULL, updated = ? WHERE id = ?",
                       (pid, time.time(), run_id))
            db.execute("COMMIT")
        return self.get(run_id)

    def request_cancel(self, run_id: str) -> Run:
        run = self.get(run_id)
        if run.status in ("done", "failed", "cancelled", "open"):  # an open run: its stage jobs are cancelled
            return run
        if run.status == "queued" and not run.worker_alive or run.interrupted:
            self.update(run.id, status="cancelled", cancel_requested=1, message="cancelled")
        else:
            self.update(run.id, cancel_requested=1)
        return self.get(run.id)

    def cancel_requested(self, run_id: str) -> bool:
        with self._connect() as db:
            row = db.execute("SELECT cancel_requested FROM runs WHERE id = ?", (run_id,)).fetchone()
        return bool(row and row[0])

    # Steps ---------------------------------------------------------------------------------------------

    def steps(self, run_id: str) -> list[Step]:
        with self._connect() as db:
            rows = db.execute("SELECT * FROM steps WHERE run_id = ? ORDER BY started, name", (run_id,)).fetchall()
        return [_step(r) for r in rows]

    def step(self, run_id: str, name: str) -> Step | None:
        with self._connect() as db:
            row = db.execute("SELECT * FROM steps WHERE run_id = ? AND name = ?", (run_id, name)).fetchone()
        return _step(row) if row else None

    def start_step(self, run_id: str, name: str) -> None:
        with self._connect() as db:
            db.execute("INSERT INTO steps (run_id, name, status, started) VALUES (?, ?, 'running', ?) "
                       "ON CONFLICT (run_id, name) DO UPDATE SET status = 'running', error = NULL, started = ?, "
                       "files = NULL, inputs = NULL",
                       (run_id, name, time.time(), time.time()))

    def finish_step(self, run_id: str, name: str, output, status: str = "done", files: dict | None = None,
                    inputs: dict | None = None) -> None:
        """files: {relative path: {"sha256", "size"}} it wrote; inputs: {step name: digest} it consumed."""
        with self._connect() as db:
            db.execute("UPDATE steps SET status = ?, output = ?, finished = ?, files = ?, inputs = ? "
                       "WHERE run_id = ? AND name = ?",
                       (status, json.dumps(output), time.time(), json.dumps(files or {}), json.dumps(inputs or {}),
                        run_id, name))

    def fail_step(self, run_id: str, name: str, error: str) -> None:
        with self._connect() as db:
            db.execute("UPDATE steps SET status = 'failed', error = ?, finished = ? WHERE run_id = ? AND name = ?",
                       (error, time.time(), run_id, name))


def _run(row: sqlite3.Row) -> Run:
    return Run(
        id=row["id"], kind=row["kind"], params=json.loads(row["params"]), status=row["status"], stage=row["stage"],
        progress=row["progress"], message=row["message"], error=row["error"],
        result=json.loads(row["result"]) if row["result"] else None, pid=row["pid"],
        cancel_requested=bool(row["cancel_requested"]), created=row["created"], updated=row["updated"],
        finished=row["finished"],
    )


def _step(row: sqlite3.Row) -> Step:
    return Step(name=row["name"], status=row["status"], output=json.loads(row["output"]) if row["output"] else None,
                error=row["error"], started=row["started"], finished=row["finished"],
                files=json.loads(row["files"]) if row["files"] else None,
                inputs=json.loads(row["inputs"]) if row["inputs"] else None)


def _migrate(db: sqlite3.Connection) -> None:
    """Bring a database made by an older version up to SCHEMA_VERSION (rows already there stay as they are)."""
    if db.execute("PRAGMA user_version").fetchone()[0] >= SCHEMA_VERSION:
        return
    db.execute("BEGIN IMMEDIATE")  # two processes opening an old database at once: one migrates
    try:
        have = {row[1] for row in db.execute("PRAGMA table_info(steps)")}
        for column, kind in STEP_COLUMNS.items():
            if column not in have:
                db.execute(f"ALTER TABLE steps ADD COLUMN {column} {kind}")
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
