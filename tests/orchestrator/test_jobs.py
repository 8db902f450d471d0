"""The job store on its own: real SQLite files, and the CLI as a real process."""

import sqlite3

import pytest

from orchestrator.jobs import JobError, JobStore
from orchestrator.settings import Settings
from tests.orchestrator.conftest import run_cli


@pytest.fixture
def home_settings(tmp_path) -> Settings:
    return Settings(home=tmp_path / "home")


@pytest.mark.parametrize("typed", ["%", "_", "2%", "2_", "%-%", "____"])
def test_wildcards_in_a_typed_id_match_nothing(home_settings, typed):
    store = JobStore(home_settings.jobs_db)
    run = store.create_run("article", {"topic": "wildcards"})
    with pytest.raises(JobError, match="no run"):
        store.get(typed)
    result = run_cli(home_settings, "show", typed)
    assert result.returncode == 1 and "no run" in result.stderr and "Traceback" not in result.stderr
    assert store.get(run.id[:8]).id == run.id  # a real prefix still finds it


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
        store.get("20250101-000000-aa")
    assert store.get("20250101-000000_").id == "20250101-000000_ccccc"  # '_' is itself, not any character
    assert store.get("20250101-000000-aab").id == "20250101-000000-aabbbb"
