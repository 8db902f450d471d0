"""Who changed which part of a run, and every version of it: a part is a step (research holds the outline,
write:NN a section, illustrate:NN an image, assemble the article), and each change to one, by the pipeline or
by an agent, is a new version recorded with its client and tool in the same transaction as the change."""

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.jobs import JobError, JobStore, step_digest


@dataclass(frozen=True)
class Actor:
    client: str  # an MCP client's name (clientInfo.name), "cli" or "pipeline"
    tool: str  # the tool or command that made the change


PIPELINE = Actor("pipeline", "start_pipeline")


class VersionConflict(JobError):
    """An edit made against a version that is no longer the current one."""

    def __init__(self, message: str, current: int):
        super().__init__(message)
        self.current = current


@dataclass
class Entry:
    part: str
    version: int
    client: str
    tool: str
    at: float
    digest: str
    note: str | None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def commit(
    store: JobStore,
    run_id: str,
    part: str,
    output,
    files: dict,
    inputs: dict,
    actor: Actor,
    content: str | None = None,
    note: str | None = None,
    expected_version: int | None = None,
    write: Callable[[object, int], None] | None = None,
    started: float | None = None,
) -> int:
    """Mark the part's step done with this output and record the change as its next version; returns it.
    expected_version: refuse (VersionConflict) unless the part is still at that version. write(db, current version):
    writes the part's files (and any row that changes with it), called once the version is checked and before the rows
    change, inside the same transaction, so two editors cannot interleave. started: when the work began (None: keep what start_step recorded)."""
    with store.transaction() as db:
        current = _current(db, run_id, part)
        if expected_version is not None and expected_version != current:
            last = db.execute(
                "SELECT client, tool FROM history WHERE run_id = ? AND part = ? AND version = ?",
                (run_id, part, current),
            ).fetchone()
            by = f" (by {last['client']} with {last['tool']})" if last else ""
            raise VersionConflict(
                f"{describe(part)} is at version {current}{by}, not {expected_version}: read it "
                f"again with get_run and make your change to version {current}",
                current,
            )
        if write is not None:
            write(db, current)
        now = time.time()
        db.execute(
            "INSERT INTO steps (run_id, name, status, output, started, finished, files, inputs) "
            "VALUES (?, ?, 'done', ?, ?, ?, ?, ?) ON CONFLICT (run_id, name) DO UPDATE SET status = 'done', "
            "output = excluded.output, error = NULL, finished = excluded.finished, files = excluded.files, "
            "inputs = excluded.inputs, started = coalesce(?, steps.started)",
            (
                run_id,
                part,
                json.dumps(output),
                started or now,
                now,
                json.dumps(files),
                json.dumps(inputs),
                started,
            ),
        )
        db.execute(
            "INSERT INTO history (run_id, part, version, client, tool, at, digest, content, note) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                run_id,
                part,
                current + 1,
                actor.client,
                actor.tool,
                now,
                step_digest(output, files),
                content,
                note,
            ),
        )
    return current + 1


def _current(db, run_id: str, part: str) -> int:
    row = db.execute(
        "SELECT max(version) FROM history WHERE run_id = ? AND part = ?", (run_id, part)
    ).fetchone()
    return row[0] or 0


def entries(store: JobStore, run_id: str) -> list[Entry]:
    """Every change to the run's parts, oldest first."""
    with store.transaction() as db:
        rows = db.execute(
            "SELECT part, version, client, tool, at, digest, note FROM history WHERE run_id = ? "
            "ORDER BY at, part, version",
            (run_id,),
        ).fetchall()
    return [Entry(**dict(r)) for r in rows]


def content(store: JobStore, run_id: str, part: str, version: int) -> str | None:
    """The stored text of one version of an outline or a section."""
    with store.transaction() as db:
        row = db.execute(
            "SELECT content FROM history WHERE run_id = ? AND part = ? AND version = ?",
            (run_id, part, version),
        ).fetchone()
    return row[0] if row else None


def describe(part: str) -> str:
    if part == "research":
        return "the outline"
    kind, _, index = part.partition(":")
    names = {"write": "section", "illustrate": "image", "review": "the review of section"}
    if kind in names:
        return f"{names[kind]} {int(index)}"
    return f"the {part} step"


def latest(store: JobStore, run_id: str, part: str) -> Entry | None:
    with store.transaction() as db:
        row = db.execute(
            "SELECT part, version, client, tool, at, digest, note FROM history WHERE run_id = ? AND "
            "part = ? ORDER BY version DESC LIMIT 1",
            (run_id, part),
        ).fetchone()
    return Entry(**dict(row)) if row else None


def remark(store: JobStore, run_id: str, part: str, digest: str, actor: Actor, note: str) -> int:
    """A remark on a part that leaves it as it is (a review's rejection): recorded as the next version of
    `part` (review:NN), with the digest of what it is about."""
    with store.transaction() as db:
        version = _current(db, run_id, part) + 1
        db.execute(
            "INSERT INTO history (run_id, part, version, client, tool, at, digest, note) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (run_id, part, version, actor.client, actor.tool, time.time(), digest, note),
        )
    return version
