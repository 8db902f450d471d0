"""A job's worker is its process, not its pid: once a worker has died, the pid it had may be handed to any
process, and that process must not keep the job's place in the pool, stop the queue or keep a cancel waiting.

Real workers (`python -m orchestrator work ID`, started by the pool) hang on an LLM server that never answers
and are killed with SIGKILL. Forcing the kernel to give a dead worker's pid to a chosen process is not possible
in a test, so the pid in the job store is then set to that of a live bystander (`sleep`) while the start time
recorded with it stays the dead worker's: the row as it reads once the pid has been reused."""

import os
import signal
import socket
import sqlite3
import subprocess
import time

import pytest

from common.procs import boot_id, cmdline, pid_alive, start_time
from common.settings import Settings
from orchestrator import api
from orchestrator.jobs import JobStore, Run
from tests.serving import wait_for

ARTICLE = {"topic": "palimpsests", "sections": 1, "images": 0, "words_per_section": 30}


@pytest.fixture
def silent_llm():
    """An LLM server that takes connections and never answers: a worker waits on it until it is killed."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        yield f"http://127.0.0.1:{server.getsockname()[1]}/v1"


@pytest.fixture
def settings(tmp_path, silent_llm):
    settings = Settings(home=tmp_path / "home", llm_urls=(silent_llm,), max_jobs=1, max_queued_per_client=5)
    yield settings
    store = JobStore(settings.jobs_db)
    for run in store.recent(100):
        if run.status in ("queued", "running"):
            store.request_cancel(run.id)  # nothing waiting is started once its worker is gone
    for run in store.recent(100):
        if run.worker_alive and run.pid != os.getpid() and "work" in (cmdline(run.pid) or []):
            os.kill(run.pid, signal.SIGKILL)


@pytest.fixture
def bystander():
    """A process that has nothing to do with the pool: it gets the pid of a worker that died."""
    proc = subprocess.Popen(["sleep", "120"])
    yield proc
    proc.kill()
    proc.wait()


def working(store: JobStore, run_id: str, timeout: float = 60) -> Run:
    """The run once a worker of the pool has claimed it (its own process is recorded, running it)."""

    def claimed():
        run = store.get(run_id)
        args = (cmdline(run.pid) if run.pid else None) or []
        return run if run.status == "running" and run.worker_alive and args[-2:] == ["work", run_id] else None

    return wait_for(claimed, timeout=timeout)


def give_pid_to(store: JobStore, run_id: str, bystander: subprocess.Popen) -> int:
    """Kill the run's process; then its row names the bystander's pid, with the start time it had recorded."""
    dead = store.get(run_id).pid
    os.kill(dead, signal.SIGKILL)
    wait_for(lambda: not pid_alive(dead), timeout=30, interval=0.02)
    with sqlite3.connect(store.path) as db:
        db.execute("UPDATE runs SET pid = ? WHERE id = ?", (bystander.pid, run_id))
    assert pid_alive(bystander.pid) and store.get(run_id).pid == bystander.pid
    return dead


def a_worker_that_died(settings: Settings, bystander: subprocess.Popen) -> tuple[JobStore, Run, Run]:
    """(the store, a running job whose worker died and whose pid the bystander got, a job queued behind it)."""
    store = JobStore(settings.jobs_db)
    first = working(store, api.start_article(ARTICLE, settings).id)
    # The row names its worker by more than the pid: its start time and boot
    assert first.pid_start == start_time(first.pid) and first.pid_boot == boot_id()
    second = api.start_article({**ARTICLE, "topic": "vellum"}, settings)
    assert second.status == "queued" and second.queue_position == 1  # one place, taken by the first
    give_pid_to(store, first.id, bystander)
    return store, store.get(first.id), second


def test_a_place_held_by_a_reused_pid_is_freed_and_the_queue_moves(settings, bystander):
    store, first, second = a_worker_that_died(settings, bystander)
    assert not first.worker_alive and first.interrupted
    api.get(second.id, settings)  # looking at the queue moves it on, as a listing does
    started = working(store, second.id, timeout=30)
    assert started.pid != bystander.pid and started.queue_position is None
    listed = {r["id"]: r for r in api.list_runs(settings=settings)}
    assert listed[first.id]["interrupted"] and listed[first.id]["status"] == "running"  # resumable, no place
    assert bystander.poll() is None  # never signalled: it is not the worker


def test_cancel_of_a_job_whose_worker_is_gone_ends_it_at_once(settings, bystander):
    store, first, _ = a_worker_that_died(settings, bystander)
    cancelled = api.cancel(first.id, settings)
    assert cancelled.status == "cancelled" and cancelled.finished is not None
    assert store.get(first.id).status == "cancelled" and not store.get(first.id).interrupted
    assert bystander.poll() is None


def test_resume_gives_a_job_whose_worker_is_gone_a_new_worker(settings, bystander):
    store, first, second = a_worker_that_died(settings, bystander)
    assert api.cancel(second.id, settings).status == "cancelled"  # so that the resumed job has the one place
    api.resume(first.id, settings)
    resumed = working(store, first.id, timeout=30)
    assert resumed.pid != bystander.pid and resumed.pid_start == start_time(resumed.pid)


def test_a_job_taken_by_a_dispatcher_that_died_waits_again(settings, bystander):
    """A dispatcher marks the job it takes as its own, then starts its worker; one that dies in between leaves
    the job to the next dispatch, also once its pid belongs to someone else."""
    store = JobStore(settings.jobs_db)
    job = store.create_run("article", ARTICLE, client="api")
    dispatcher = subprocess.Popen(["sleep", "120"])
    while start_time(dispatcher.pid) == start_time(bystander.pid):  # started in one clock tick: no swap below
        dispatcher.kill()
        dispatcher.wait()
        time.sleep(0.02)
        dispatcher = subprocess.Popen(["sleep", "120"])
    store.update(job.id, pid=dispatcher.pid)  # as pool._take marks it, with the dispatcher's start time
    assert store.get(job.id).worker_alive and api.get(job.id, settings).queue_position is None  # taken
    dispatcher.kill()
    dispatcher.wait()
    with sqlite3.connect(settings.jobs_db) as db:
        db.execute("UPDATE runs SET pid = ? WHERE id = ?", (bystander.pid, job.id))
    assert not store.get(job.id).worker_alive
    assert api.get(job.id, settings).status in ("queued", "running")  # handed to a worker of its own
    assert working(store, job.id, timeout=30).pid != bystander.pid


def test_a_process_recorded_in_another_boot_is_not_this_one(settings):
    """Start times count from the boot: a job store that outlives a reboot may name a pid that the new boot gave
    out at the same tick. The boot recorded with it tells them apart."""
    store = JobStore(settings.jobs_db)
    job = store.create_run("article", ARTICLE, status="running", client="cli", pid=os.getpid())
    assert store.get(job.id).worker_alive
    with sqlite3.connect(settings.jobs_db) as db:
        db.execute("UPDATE runs SET pid_boot = 'a boot before this one' WHERE id = ?", (job.id,))
    assert store.get(job.id).interrupted
    assert api.cancel(job.id, settings).status == "cancelled"


V3_RUNS = """CREATE TABLE runs (id TEXT PRIMARY KEY, kind TEXT NOT NULL, params TEXT NOT NULL, status TEXT NOT NULL,
    stage TEXT, progress REAL NOT NULL DEFAULT 0, message TEXT, error TEXT, result TEXT, pid INTEGER,
    cancel_requested INTEGER NOT NULL DEFAULT 0, created REAL NOT NULL, updated REAL NOT NULL, finished REAL,
    client TEXT, queued_at REAL)"""


def test_a_job_store_from_before_start_times_is_migrated_and_its_rows_kept(settings, bystander):
    settings.jobs_db.parent.mkdir(parents=True)
    columns = "id, kind, params, status, result, pid, created, updated, finished, client, queued_at"
    rows = [
        ("done-run", "article", '{"topic": "t"}', "done", '{"md": "a"}', None, 1.0, 2.0, 2.0, "cli", None),
        ("old-worker", "article", '{"topic": "u"}', "running", None, bystander.pid, 3, 4, None, "api", 3),
    ]
    with sqlite3.connect(settings.jobs_db) as db:
        db.execute(V3_RUNS)
        db.executemany(f"INSERT INTO runs ({columns}) VALUES ({', '.join('?' * 11)})", rows)
        db.execute("PRAGMA user_version = 3")
        before = db.execute("SELECT * FROM runs ORDER BY id").fetchall()

    store = JobStore(settings.jobs_db)
    with sqlite3.connect(settings.jobs_db) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 4
        assert db.execute("SELECT * FROM runs ORDER BY id").fetchall() == [(*r, None, None) for r in before]
    # A worker of the version before wrote its pid alone: that pid decides, so a worker still running through
    # the upgrade keeps its place and its job is not taken from it.
    old = store.get("old-worker")
    assert old.worker_alive and not old.interrupted and old.pid_start is None
    assert store.get("done-run").result == {"md": "a"}
    # From now on a pid is written with its process.
    store.update("old-worker", pid=os.getpid())
    assert store.get("old-worker").pid_start == start_time(os.getpid())
