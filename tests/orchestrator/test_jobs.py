"""The job store on its own: real SQLite files, and the CLI as a real process. Ids are exact in the store's get
(what the API and the MCP tools use); only the CLI takes a unique prefix, and says which run it named."""

import json
import sqlite3

import pytest

from common.settings import Settings
from orchestrator.jobs import JobError, JobStore
from tests.orchestrator.conftest import run_cli


@pytest.fixture
def home_settings(tmp_path) -> Settings:
    return Settings(home=tmp_path / "home")


@pytest.mark.parametrize("typed", ["%", "_", "2%", "2_", "%-%", "____"])
def test_wildcards_in_a_typed_id_match_nothing(home_settings, typed):
    store = JobStore(home_settings.jobs_db)
    run = store.create_run("article", {"topic": "wildcards"})
    for lookup in (store.get, store.find):
        with pytest.raises(JobError, match="no run"):
            lookup(typed)
    result = run_cli(home_settings, "show", typed)
    assert result.returncode == 1 and "no run" in result.stderr and "Traceback" not in result.stderr
    assert store.find(run.id[:8]).id == run.id  # a real prefix still finds it at the CLI


def test_the_store_and_api_take_exact_ids_only(home_settings):
    from orchestrator import api

    run = JobStore(home_settings.jobs_db).create_run("article", {"topic": "exact"}, status="done")
    for typed in (run.id[:1], run.id[:8], run.id[:-1], run.id + " "):
        with pytest.raises(JobError, match="no run"):
            api.get(typed, home_settings)
        with pytest.raises(JobError, match="no run"):
            api.cancel(typed, home_settings)
    assert api.get(run.id, home_settings).id == run.id
    shown = run_cli(home_settings, "show", run.id[:15], "--json")
    assert shown.returncode == 0 and f"run {run.id}" in shown.stderr  # the CLI names the run a prefix matched


def test_an_empty_id_matches_nothing(home_settings):
    store = JobStore(home_settings.jobs_db)
    store.create_run("article", {"topic": "only one"})
    with pytest.raises(JobError, match="no run"):
        store.get("")


def test_a_prefix_shared_by_two_runs_is_ambiguous(home_settings):
    store = JobStore(home_settings.jobs_db)
    with sqlite3.connect(home_settings.jobs_db) as db:
        for run_id in ("20250101-000000-aaaaaa", "20250101-000000-aabbbb", "20250101-000000_ccccc"):
            db.execute("INSERT INTO runs (id, kind, params, status, created, updated) "
                       "VALUES (?, 'article', '{\"topic\": \"t\"}', 'done', 0, 0)", (run_id,))
    with pytest.raises(JobError, match="ambiguous"):
        store.find("20250101-000000-aa")
    assert store.find("20250101-000000_").id == "20250101-000000_ccccc"  # '_' is itself, not any character
    assert store.find("20250101-000000-aab").id == "20250101-000000-aabbbb"
    with pytest.raises(JobError, match="no run"):
        store.get("20250101-000000-aab")


OLD_STEPS = """CREATE TABLE steps (run_id TEXT NOT NULL REFERENCES runs(id) ON DELETE CASCADE, name TEXT NOT NULL,
    status TEXT NOT NULL, output TEXT, error TEXT, started REAL, finished REAL, PRIMARY KEY (run_id, name))"""


def test_a_database_from_before_hashes_is_migrated_in_place(home_settings):
    home_settings.jobs_db.parent.mkdir(parents=True)
    with sqlite3.connect(home_settings.jobs_db) as db:
        db.execute("CREATE TABLE runs (id TEXT PRIMARY KEY, kind TEXT NOT NULL, params TEXT NOT NULL, status TEXT "
                   "NOT NULL, stage TEXT, progress REAL NOT NULL DEFAULT 0, message TEXT, error TEXT, result TEXT, "
                   "pid INTEGER, cancel_requested INTEGER NOT NULL DEFAULT 0, created REAL NOT NULL, "
                   "updated REAL NOT NULL, finished REAL)")
        db.execute(OLD_STEPS)
        db.execute("INSERT INTO runs (id, kind, params, status, created, updated) "
                   "VALUES ('old-run', 'article', '{\"topic\": \"t\"}', 'failed', 0, 0)")
        db.execute("INSERT INTO steps VALUES ('old-run', 'write:00', 'done', '\"sections/00.md\"', NULL, 1, 2)")
    store = JobStore(home_settings.jobs_db)
    old = store.step("old-run", "write:00")
    assert old.output == "sections/00.md" and old.files is None and old.inputs is None  # presence-only

    store.start_step("old-run", "write:01")
    store.finish_step("old-run", "write:01", "sections/01.md", files={"sections/01.md": {"sha256": "ab", "size": 2}},
                      inputs={"research": "cd"})
    new = store.step("old-run", "write:01")
    assert new.files == {"sections/01.md": {"sha256": "ab", "size": 2}} and new.inputs == {"research": "cd"}
    assert new.digest != old.digest
    JobStore(home_settings.jobs_db)  # opening it again changes nothing
    with sqlite3.connect(home_settings.jobs_db) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] >= 2
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_the_cli_listing_shows_queue_positions(home_settings):
    import os

    store = JobStore(home_settings.jobs_db)
    store.create_run("article", {"topic": "held"}, status="running", client="cli", pid=os.getpid())  # the one place
    waiting = [store.create_run("article", {"topic": f"waits {i}"}, client="cli").id for i in range(2)]
    one_place = {"SCRIPTORIUM_MAX_JOBS": "1"}
    listed = json.loads(run_cli(home_settings, "list", "--json", extra_env=one_place).stdout)["runs"]
    assert {r["id"]: r["queue_position"] for r in listed if r["id"] in waiting} == {waiting[0]: 1, waiting[1]: 2}
    text = run_cli(home_settings, "list", extra_env=one_place).stdout
    assert f"{waiting[1]}  queued #2" in text
    shown = json.loads(run_cli(home_settings, "show", waiting[1], "--json", extra_env=one_place).stdout)
    assert shown["status"] == "queued" and shown["queue_position"] == 2
    cancelled = run_cli(home_settings, "cancel", waiting[0], "--json", extra_env=one_place)
    assert json.loads(cancelled.stdout)["status"] == "cancelled"
    assert store.get(waiting[1]).status == "queued" and store.get(waiting[1]).pid is None  # still waiting, now first
