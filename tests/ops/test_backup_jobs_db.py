"""The job database in a backup is the data directory's own: the file that was checked, never another database
a link swapped in at its path meanwhile, and with the commits that are still only in its write-ahead log. Real
SQLite files, real links, the real `ops` command."""

import json
import os
import sqlite3
from pathlib import Path

import pytest

from ops import backup
from tests.backend.server_process import ROOT
from tests.ops.backup_victim import leaks
from tests.ops.conftest import run_ops

ENV = {"SCRIPTORIUM_COMPOSE": str(ROOT / "compose.yaml")}
OTHER = b"another database's secret row"


def database(path: Path, row: bytes) -> None:
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE runs (body BLOB)")
        db.execute("INSERT INTO runs VALUES (?)", (row,))
    db.close()


@pytest.mark.parametrize("swap", ["replaced", "moved-aside"])
def test_a_link_swapped_in_after_the_check_is_never_what_is_copied(tmp_path, monkeypatch, swap):
    home, root, other = tmp_path / "home", tmp_path / "backups", tmp_path / "other.db"
    home.mkdir()
    database(home / "jobs.db", b"our own run")
    database(other, OTHER)
    other_before = other.read_bytes()
    real_connect = sqlite3.connect
    swapped = []

    def connect(*args, **kwargs):  # the moment between the check of jobs.db and SQLite opening a database
        if not swapped:
            swapped.append(args[0])
            if swap == "replaced":  # the rename-swap: a link takes jobs.db's name in one step
                (home / "swap").symlink_to(other)
                os.replace(home / "swap", home / "jobs.db")
            else:
                os.rename(home / "jobs.db", home / "jobs.db.moved")
                (home / "jobs.db").symlink_to(other)
        return real_connect(*args, **kwargs)

    monkeypatch.setattr(sqlite3, "connect", connect)
    made = backup.create(home, root, [])
    monkeypatch.setattr(sqlite3, "connect", real_connect)
    assert swapped  # the swap happened, after jobs.db was checked
    assert "jobs.db" not in {f["path"] for f in made.files} and leaks(root, OTHER) == []
    notes = {s["path"]: s["note"] for s in made.skipped}
    assert "replaced" in notes["jobs.db"] and "not copied" in notes["jobs.db"]
    assert other.read_bytes() == other_before
    assert backup.verify(root, made) == []


def test_the_copy_holds_the_commits_that_are_only_in_the_write_ahead_log(tmp_path):
    home, root = tmp_path / "home", tmp_path / "backups"
    home.mkdir()
    writer = sqlite3.connect(home / "jobs.db", isolation_level=None)
    try:
        writer.execute("PRAGMA journal_mode=WAL")
        writer.execute("PRAGMA wal_autocheckpoint=0")  # nothing moves into jobs.db itself while it is open
        writer.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY, body TEXT)")
        for i in range(40):
            writer.execute("INSERT INTO runs (body) VALUES (?)", (f"only in the log {i}",))
        assert b"only in the log" not in (home / "jobs.db").read_bytes()
        assert b"only in the log" in (home / "jobs.db-wal").read_bytes()
        made = run_ops(home, "backup", "--to", str(root), "--json", env=ENV, timeout=120)
        assert made.returncode == 0, made.stderr
        stored = Path(json.loads(made.stdout)["path"]) / "jobs.db"
        with sqlite3.connect(stored) as copy:
            assert copy.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            assert copy.execute("SELECT count(*) FROM runs").fetchone()[0] == 40
        copy.close()
        writer.execute("INSERT INTO runs (body) VALUES ('after the backup')")  # the source's log still works
        assert writer.execute("SELECT count(*) FROM runs").fetchone()[0] == 41
    finally:
        writer.close()
    assert run_ops(home, "backup", "verify", "--to", str(root), env=ENV).returncode == 0
