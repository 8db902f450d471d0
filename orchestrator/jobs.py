"""Runs and their steps in SQLite, so a job outlives the process that started it."""

import json
import sqlite3
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from orchestrator.job_rows import Run, Step, run_from, step_digest, step_from, worker_columns
from orchestrator.job_schema import SCHEMA, migrate
from orchestrator.store_errors import describe

__all__ = ["ACTIVE", "JobError", "JobStore", "Run", "Step", "StoreError", "UnknownRun", "step_digest"]

ACTIVE = ("queued", "running")


class JobError(Exception):
    pass


class UnknownRun(JobError):
    """No run has the id asked for."""


class StoreError(JobError):
    """The job database cannot be opened or written (a full disk, a read-only data directory)."""


class JobStore:
    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(describe(self.path, e)) from None
        with self._connect() as db:
            db.executescript(SCHEMA)
            migrate(db)

    @contextmanager
    def _connect(self):
        try:
            db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        except sqlite3.Error as e:
            raise StoreError(describe(self.path, e)) from None
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
        except sqlite3.OperationalError as e:  # full, read-only, unopenable: SQLite has rolled the change back
            raise StoreError(describe(self.path, e)) from None
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
                if db.in_transaction:  # an I/O error may have rolled it back already
                    db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    # Runs ----------------------------------------------------------------------------------------------

    def create_run(self, kind: str, params: dict, status: str = "queued", client: str | None = None,
                   pid: int | None = None, db: sqlite3.Connection | None = None) -> Run:
        """A new run. pid: the process already working on it (a foreground run: no worker will be started for it);
        db: a connection inside a transaction to insert it with (pool.py checks the queue in the same one)."""
        now = time.time()
        run_id = time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + "-" + uuid.uuid4().hex[:6]
        worker = worker_columns(pid)
        row = (run_id, kind, json.dumps(params), status, now, now, client, worker["pid"], worker["pid_start"],
               worker["pid_boot"], now if status == "queued" else None)
        sql = "INSERT INTO runs (id, kind, params, status, created, updated, client, pid, pid_start, pid_boot, " \
              "queued_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        if db is not None:
            db.execute(sql, row)
            return run_from(db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone())
        with self._connect() as conn:
            conn.execute(sql, row)
        return self.get(run_id)

    def get(self, run_id: str) -> Run:
        """The run with exactly this id: tools and the API never match a prefix (an id is what names a job)."""
        with self._connect() as db:
            row = db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise UnknownRun(f"no run {run_id!r}; `python -m orchestrator list` shows the runs")
        return run_from(row)

    def find(self, typed: str) -> Run:
        """The run with this id or, for people typing ids from `list` at the CLI, the one run it is a prefix of."""
        with self._connect() as db:
            row = db.execute("SELECT * FROM runs WHERE id = ?", (typed,)).fetchone()
            if row is None and typed:
                # substr, not LIKE: '%' and '_' in what was typed are characters, not wildcards
                rows = db.execute("SELECT * FROM runs WHERE substr(id, 1, ?) = ? LIMIT 6",
                                  (len(typed), typed)).fetchall()
                if len(rows) > 1:
                    raise JobError(f"run id {typed!r} is ambiguous: {', '.join(r['id'] for r in rows[:5])}")
                row = rows[0] if rows else None
        if row is None:
            raise UnknownRun(f"no run {typed!r}; `python -m orchestrator list` shows the runs")
        return run_from(row)

    def active(self, kinds: tuple[str, ...], db: sqlite3.Connection | None = None,
               finished_since: float | None = None) -> list[Run]:
        """Runs of these kinds that are queued or running (and those that finished after `finished_since`), in queue
        order; db: inside the caller's transaction."""
        sql = (f"SELECT * FROM runs WHERE kind IN ({', '.join('?' * len(kinds))}) "
               "AND (status IN ('queued', 'running') OR finished > ?) ORDER BY COALESCE(queued_at, created), id")
        args = (*kinds, time.time() + 1 if finished_since is None else finished_since)
        if db is not None:
            return [run_from(r) for r in db.execute(sql, args).fetchall()]
        with self._connect() as conn:
            return [run_from(r) for r in conn.execute(sql, args).fetchall()]

    def recent(self, limit: int = 50) -> list[Run]:
        with self._connect() as db:
            rows = db.execute("SELECT * FROM runs ORDER BY created DESC LIMIT ?", (limit,)).fetchall()
        return [run_from(r) for r in rows]

    def page(self, limit: int, before: tuple[float, str] | None = None) -> list[Run]:
        """Runs newest first, starting after `before` (the created time and id of the last one already seen)."""
        with self._connect() as db:
            if before is None:
                rows = db.execute("SELECT * FROM runs ORDER BY created DESC, id DESC LIMIT ?", (limit,)).fetchall()
            else:
                rows = db.execute("SELECT * FROM runs WHERE created < ? OR (created = ? AND id < ?) "
                                  "ORDER BY created DESC, id DESC LIMIT ?",
                                  (before[0], before[0], before[1], limit)).fetchall()
        return [run_from(r) for r in rows]

    def update(self, run_id: str, **fields) -> None:
        """Set these columns. A pid is recorded with the identity of the process that has it now (worker_columns):
        this process, or a child not yet reaped, so that it is the process meant."""
        if "pid" in fields:
            fields.update(worker_columns(fields["pid"]))
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
            run = run_from(row)
            if run.status in ("done", "cancelled"):
                db.execute("ROLLBACK")
                raise JobError(f"run {run_id} is {run.status}; nothing to resume")
            if run.pid is not None and run.pid != pid and run.worker_alive and run.status == "running":
                db.execute("ROLLBACK")
                raise JobError(f"run {run_id} is being worked on by process {run.pid}")
            worker = worker_columns(pid)
            db.execute("UPDATE runs SET status = 'running', pid = ?, pid_start = ?, pid_boot = ?, error = NULL, "
                       "updated = ? WHERE id = ?",
                       (worker["pid"], worker["pid_start"], worker["pid_boot"], time.time(), run_id))
            db.execute("COMMIT")
        return self.get(run_id)

    def request_cancel(self, run_id: str) -> Run:
        """Cancel a run: one no process works on (waiting in the queue, or interrupted) at once, a running one
        by its worker, which looks at the flag between requests. In one transaction, so a queued run is never
        started by a worker pool and marked cancelled at the same time."""
        with self.transaction() as db:
            row = db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
            if row is None:
                raise UnknownRun(f"no run {run_id!r}; `python -m orchestrator list` shows the runs")
            run, now = run_from(row), time.time()
            if run.status in ("done", "failed", "cancelled", "open"):  # an open run: its stage jobs are cancelled
                return run
            if run.status == "queued" and not run.worker_alive or run.interrupted:
                db.execute("UPDATE runs SET status = 'cancelled', cancel_requested = 1, message = 'cancelled', "
                           "updated = ?, finished = ? WHERE id = ?", (now, now, run_id))
            else:
                db.execute("UPDATE runs SET cancel_requested = 1, updated = ? WHERE id = ?", (now, run_id))
        return self.get(run_id)

    def cancel_requested(self, run_id: str) -> bool:
        with self._connect() as db:
            row = db.execute("SELECT cancel_requested FROM runs WHERE id = ?", (run_id,)).fetchone()
        return bool(row and row[0])

    # Steps ---------------------------------------------------------------------------------------------

    def steps(self, run_id: str) -> list[Step]:
        with self._connect() as db:
            rows = db.execute("SELECT * FROM steps WHERE run_id = ? ORDER BY started, name", (run_id,)).fetchall()
        return [step_from(r) for r in rows]

    def step(self, run_id: str, name: str) -> Step | None:
        with self._connect() as db:
            row = db.execute("SELECT * FROM steps WHERE run_id = ? AND name = ?", (run_id, name)).fetchone()
        return step_from(row) if row else None

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
