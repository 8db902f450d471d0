"""Backups: checksummed, consistent under writes, restorable byte for byte, pruned by calendar."""

import json
import sqlite3
import threading
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from ops import backup
from orchestrator.jobs import JobStore
from tests.backend.server_process import ROOT
from tests.ops.conftest import run_ops

ENV = {"SCRIPTORIUM_COMPOSE": str(ROOT / "compose.yaml")}


@pytest.fixture
def home(tmp_path):
    home = tmp_path / "home"
    store = JobStore(home / "jobs.db")
    for i in range(3):
        run = store.create_run("article", {"topic": f"topic {i}"})
        store.start_step(run.id, "research")
        store.finish_step(run.id, "research", {"title": f"t{i}"})
        run_dir = home / "runs" / run.id
        (run_dir / "images").mkdir(parents=True)
        (run_dir / "article.md").write_text(f"# Article {i}\n")
        (run_dir / "images" / "00.png").write_bytes(bytes(range(256)) * (i + 1))
    (home / "config.toml").write_text('mcp_budget = 30\n')
    (home / "models" / "smollm2").mkdir(parents=True)
    (home / "models" / "smollm2" / "weights.gguf").write_bytes(b"GGUF" + b"\x01" * 4096)
    return home


def backup_ids(home) -> list[str]:
    return [b["id"] for b in json.loads(run_ops(home, "backup", "list", "--json", env=ENV).stdout)["backups"]]


def test_a_flipped_byte_is_named_by_verify(home):
    made = run_ops(home, "backup", "--json", env=ENV)
    assert made.returncode == 0, made.stderr
    info = json.loads(made.stdout)
    assert run_ops(home, "backup", "verify", env=ENV).returncode == 0
    manifest = json.loads((Path(info["path"]) / "manifest.json").read_text())
    paths = {f["path"] for f in manifest["files"]}
    assert {"jobs.db", "configs/compose.yaml", "configs/config.toml"} <= paths
    assert sum(p.startswith("runs/") for p in paths) == 6 and not any(p.startswith("models/") for p in paths)
    victim = Path(info["path"]) / next(p for p in sorted(paths) if p.endswith("00.png"))
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF
    victim.write_bytes(bytes(data))
    result = run_ops(home, "backup", "verify", info["id"], env=ENV)
    assert result.returncode == 1
    assert f"corrupt: {victim.relative_to(info['path'])}" in result.stderr
    (Path(info["path"]) / "jobs.db").unlink()
    assert "missing: jobs.db" in run_ops(home, "backup", "verify", env=ENV).stderr


def test_backup_while_jobs_write_restores_to_a_sound_database(home, tmp_path):
    store = JobStore(home / "jobs.db")
    stop, three = threading.Event(), threading.Event()

    def writer():
        i = 0
        try:
            while not stop.is_set():
                run = store.create_run("article", {"topic": f"busy {i}", "blob": "x" * 2000})
                store.update(run.id, progress=0.5, message="writing")
                i += 1
                if i >= 3:
                    three.set()
        finally:
            three.set()  # a writer that failed ends the wait (the count of runs below then fails)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert three.wait(60)  # every backup holds at least these three runs, and the writer goes on beside them
        made = [backup.create(home, home / "backups", []) for _ in range(3)]
    finally:
        stop.set()
        thread.join()
    for i, b in enumerate(made):
        target = tmp_path / f"restored-{i}"
        backup.restore(home / "backups", b, target)
        with sqlite3.connect(target / "jobs.db") as db:
            assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            assert db.execute("SELECT count(*) FROM runs").fetchone()[0] >= 3


def test_restore_round_trip_is_byte_identical_and_refuses_to_overwrite(home, tmp_path):
    made = json.loads(run_ops(home, "backup", "--include", "models", "--json", env=ENV).stdout)
    target = tmp_path / "elsewhere"
    result = run_ops(home, "backup", "restore", made["id"], "--to", str(target), "--json", env=ENV)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((Path(made["path"]) / "manifest.json").read_text())
    for entry in manifest["files"]:
        if entry["path"].startswith(("runs/", "models/")):
            assert (target / entry["path"]).read_bytes() == (home / entry["path"]).read_bytes()
        assert backup.sha256(target / entry["path"]) == entry["sha256"]
    again = run_ops(home, "backup", "restore", made["id"], "--to", str(target), env=ENV)
    assert again.returncode == 2 and "--force" in again.stderr
    forced = run_ops(home, "backup", "restore", made["id"], "--to", str(target), "--force", env=ENV)
    assert forced.returncode == 0


def test_models_are_stored_once_across_backups(home):
    first = backup.create(home, home / "backups", [], include_models=True)
    objects = list((home / "backups" / "objects").iterdir())
    assert len(objects) == 1
    stamp = objects[0].stat().st_mtime_ns
    second = backup.create(home, home / "backups", [], include_models=True)
    assert list((home / "backups" / "objects").iterdir()) == objects and objects[0].stat().st_mtime_ns == stamp
    assert not backup.verify(home / "backups", first) and not backup.verify(home / "backups", second)


def test_prune_keeps_exactly_the_right_set(tmp_path):
    root = tmp_path / "backups"
    start = datetime(2026, 1, 1, 3, 0)
    made = []
    for day in range(40):  # 40 days, two backups each (03:00 and 15:00)
        for hour in (0, 12):
            when = start + timedelta(days=day, hours=hour)
            backup_id = when.strftime("%Y%m%d-%H%M%S-000")
            (root / backup_id).mkdir(parents=True)
            (root / backup_id / "manifest.json").write_text(json.dumps({"id": backup_id, "created": when.timestamp(),
                                                                        "files": []}))
            made.append((when, backup_id))
    removed = backup.prune(root, keep_last=3, keep_daily=7, keep_weekly=4)
    kept = {b.id for b in backup.list_backups(root)}
    # Independent expectation: the 3 newest; the newest of each of the 7 newest days; of the 4 newest ISO weeks.
    newest = sorted(made, reverse=True)
    expected = {i for _, i in newest[:3]}
    days, weeks = {}, {}
    for when, backup_id in newest:
        days.setdefault(when.date(), backup_id)
        weeks.setdefault(when.isocalendar()[:2], backup_id)
    expected |= set(list(days.values())[:7]) | set(list(weeks.values())[:4])
    assert kept == expected and len(removed) == 80 - len(expected)


def test_backup_keeps_the_copies_of_the_agent_configs_install_recorded(tmp_path, monkeypatch):
    from common.agent_configs import remember
    from ops.backup_commands import backup_configs
    from ops.stack import load

    monkeypatch.setenv("SCRIPTORIUM_HOME", str(tmp_path / "home"))
    config = tmp_path / "agent" / "config.yaml"
    config.parent.mkdir()
    config.write_text("mcp_servers: {}\n")
    copy = config.parent / "config.yaml.20260101-000000.scriptorium.bak"
    copy.write_text("old\n")
    remember(config, tmp_path / "home")
    assert copy in backup_configs(load(str(Path(__file__).resolve().parents[2] / "compose.yaml")))
