"""The job database's tables, and bringing a database made by an older version up to date in place."""

import sqlite3

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
    pid INTEGER,                    -- the process working on it, named by pid_start and pid_boot with it
    pid_start INTEGER,              -- its start time (clock ticks since boot): a reused pid has another
    pid_boot TEXT,                  -- the boot it ran in; both NULL: recorded before they were (the pid decides)
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    finished REAL,
    client TEXT,                    -- who started it: an MCP client's name, or cli
    queued_at REAL                  -- when it joined the queue of jobs waiting for a worker (orchestrator/pool.py)
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
# 1: steps without files/inputs (their outputs are checked for presence only); 2: no queue; 3: a run's process
# named by its pid alone
SCHEMA_VERSION = 4
STEP_COLUMNS = {"files": "TEXT", "inputs": "TEXT"}
RUN_COLUMNS = {"client": "TEXT", "queued_at": "REAL", "pid_start": "INTEGER", "pid_boot": "TEXT"}


def migrate(db: sqlite3.Connection) -> None:
    """Bring a database made by an older version up to SCHEMA_VERSION (rows already there stay as they are)."""
    if db.execute("PRAGMA user_version").fetchone()[0] >= SCHEMA_VERSION:
        return
    db.execute("BEGIN IMMEDIATE")  # two processes opening an old database at once: one migrates
    try:
        for table, columns in (("steps", STEP_COLUMNS), ("runs", RUN_COLUMNS)):
            have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
            for column, kind in columns.items():
                if column not in have:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
