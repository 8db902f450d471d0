"""A bounded pool of job workers: at most `max_jobs` article, stage and image jobs run at once, each in a worker process
(`python -m orchestrator work ID`); the others wait in the job store with status `queued`, in the order they came.

There is no pool process to die: the queue is the job store, and whoever changes it moves it on. Starting a job,
listing jobs and a worker finishing its job all call `dispatch`, which in one BEGIN IMMEDIATE transaction counts
the pooled jobs whose process lives and marks the next waiting one as taken (its process: the dispatching one,
until the worker it starts is written in its place). SQLite serializes two processes dispatching at once, so no job
starts twice and no more than max_jobs run; a dispatcher that dies between marking and starting leaves a process
that is gone, and the job waits again. A worker whose job is over becomes the worker of the next waiting one (exec:
the same pid and start time, a fresh interpreter), so there are never more than max_jobs worker processes, not
even for a moment.

A process is its pid with its start time and boot (common.procs, recorded by the job store with every pid): a pid
that another process got after the worker died is not the worker, so it holds no place, its running job reads
as interrupted (`resume` continues it, `cancel` ends it at once) and a job it had taken waits again.
"""

import contextlib
import os
import subprocess
import sys
import time

from common.settings import Settings
from orchestrator.job_rows import worker_columns
from orchestrator.jobs import JobError, JobStore, Run, StoreError

# Image jobs too: each waits on ComfyUI's own queue, but in a worker process of its own (~40 MB) that must be bounded
POOLED = ("article", "stage", "image")
# A worker whose job has ended holds its place until its process is gone (it is exiting, or becoming the worker of
# the next job), so that no new worker starts beside it; its run is looked at for this long after it ended.
LINGER = 120.0


class QueueFull(JobError):
    """A client has as many jobs waiting as it may."""


def spawn_worker(run_id: str, settings: Settings) -> int:
    """Start the detached process that works on the run; returns its pid."""
    settings.logs_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, SCRIPTORIUM_HOME=str(settings.home), SCRIPTORIUM_LLM_URL=",".join(settings.llm_urls),
               SCRIPTORIUM_LLM_STRUCTURED_OUTPUT="1" if settings.llm_structured_output else "0",
               SCRIPTORIUM_MAX_JOBS=str(settings.max_jobs),
               SCRIPTORIUM_MAX_QUEUED_PER_CLIENT=str(settings.max_queued_per_client))
    if settings.comfyui_url:
        env["SCRIPTORIUM_COMFYUI_URL"] = settings.comfyui_url
    with open(settings.logs_dir / f"run-{run_id}.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "work", run_id], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    JobStore(settings.jobs_db).update(run_id, pid=proc.pid)
    return proc.pid


def split(runs: list[Run]) -> tuple[int, list[Run]]:
    """(the places taken: pooled jobs with a live process, and live workers whose job has just ended; the jobs
    waiting for a worker, in queue order). This process's own ended jobs take no place: it is the one moving on."""
    active = [r for r in runs if r.status in ("queued", "running")]
    live = sum(1 for r in active if r.worker_alive)
    working = {r.pid for r in active if r.worker_alive}  # the processes behind these pids, not others with them
    leaving = {r.pid for r in runs if r.status not in ("queued", "running") and r.pid not in working
               and r.pid != os.getpid() and r.worker_alive}
    return live + len(leaving), [r for r in active if r.status == "queued" and not r.worker_alive]


def pooled(store: JobStore, db=None) -> list[Run]:
    return store.active(POOLED, db, finished_since=time.time() - LINGER)


def positions(store: JobStore) -> dict[str, int]:
    """Each waiting job's place in the queue: 1 starts next."""
    _, waiting = split(store.active(POOLED))
    return {r.id: i for i, r in enumerate(waiting, 1)}


def placed(runs: list[Run], store: JobStore) -> list[Run]:
    """The runs with their queue positions filled in."""
    if not any(r.status == "queued" and r.kind in POOLED for r in runs):
        return runs
    where = positions(store)
    for run in runs:
        run.queue_position = where.get(run.id)
    return runs


def enqueue(store: JobStore, kind: str, params: dict, settings: Settings, client: str) -> Run:
    """A new pooled job: started now when a worker is free, else queued. QueueFull when it would wait and the
    client already has max_queued_per_client jobs waiting (checked and inserted in one transaction)."""
    with store.transaction() as db:
        live, waiting = split(pooled(store, db))
        if live + len(waiting) >= settings.max_jobs:
            mine = sum(1 for r in waiting if r.client == client)
            if mine >= settings.max_queued_per_client:
                raise QueueFull(
                    f"{client!r} already has {mine} jobs waiting for a worker, the most one client may queue "
                    f"(max_queued_per_client = {settings.max_queued_per_client}, SCRIPTORIUM_MAX_QUEUED_PER_CLIENT; "
                    f"{settings.max_jobs} jobs run at once, max_jobs, SCRIPTORIUM_MAX_JOBS): wait for some to "
                    "start, or cancel some")
        run = store.create_run(kind, params, client=client, db=db)
    dispatch(store, settings)
    return placed([store.get(run.id)], store)[0]


def _take(store: JobStore, settings: Settings, skip: set[str]) -> str | None:
    """Mark the next waiting job as this process's, if fewer than max_jobs run; its id, or None."""
    with store.transaction() as db:
        live, waiting = split(pooled(store, db))
        waiting = [r for r in waiting if r.id not in skip]
        if not waiting or live >= settings.max_jobs:
            return None
        me = worker_columns(os.getpid())
        db.execute("UPDATE runs SET pid = ?, pid_start = ?, pid_boot = ? WHERE id = ?",
                   (me["pid"], me["pid_start"], me["pid_boot"], waiting[0].id))
        return waiting[0].id


def dispatch(store: JobStore, settings: Settings, keep_one: bool = False) -> str | None:
    """Start waiting jobs while fewer than max_jobs run. keep_one: the caller, a worker whose job is over, takes
    the first one itself and gets its id (see `become`); otherwise None."""
    if not split(store.active(POOLED))[1]:
        return None  # the common case, answered without taking the write lock
    kept, started = None, set()
    while (run_id := _take(store, settings, started)) is not None:
        started.add(run_id)  # a worker that dies at once is not started again by this call
        if keep_one and kept is None:
            kept = run_id
            continue
        try:
            spawn_worker(run_id, settings)
        except OSError as e:
            store.update(run_id, status="failed", pid=None, error=f"its worker could not be started: {e}")
    return kept


def settle(store: JobStore, settings: Settings) -> None:
    """dispatch for callers that only read (a listing) or whose own work is over: a job store that cannot be
    written now leaves the queue for the next caller rather than failing theirs."""
    with contextlib.suppress(StoreError, OSError):
        dispatch(store, settings)


def become(run_id: str, settings: Settings) -> None:
    """Turn this worker process into the worker of `run_id` (never returns unless exec fails): a fresh
    interpreter with the same pid, its output going to that run's log."""
    settings.logs_dir.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(settings.logs_dir / f"run-{run_id}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    try:
        os.execv(sys.executable, [sys.executable, "-m", "orchestrator", "work", run_id])
    except OSError:
        JobStore(settings.jobs_db).update(run_id, pid=None)  # it waits again for the next dispatch
        raise
