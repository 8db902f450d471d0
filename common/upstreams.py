"""What each process's LLM router knows of its upstreams, for `ops status`: state/upstreams/<pid>.json.

A router (orchestrator/clients/router.py) writes its table when it changes (at most twice a second, and at once
when an upstream fails or comes back) and removes it when it closes. `read` sums the requests in flight over the
processes still alive and keeps the latest failure; files of processes that are gone are removed.
"""

import json
import os
import time
from pathlib import Path

from common.procs import ProcessIdentity, start_time


def _dir(home: Path) -> Path:
    return home / "state" / "upstreams"


def write(home: Path, rows: list[dict]) -> None:
    """This process's table: url, models, in_flight, served, failures, last_failure, error, ejected_until."""
    folder = _dir(home)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "start": start_time(os.getpid()), "time": time.time(),
                               "upstreams": rows}))
    tmp.replace(path)  # no fsync: a table lost in a crash is stale anyway


def remove(home: Path) -> None:
    (_dir(home) / f"{os.getpid()}.json").unlink(missing_ok=True)


def read(home: Path) -> dict[str, dict]:
    """url -> {in_flight, served, processes, last_failure, error, ejected_until, models} over live processes."""
    merged: dict[str, dict] = {}
    folder = _dir(home)
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            table = json.loads(path.read_text())
            alive = ProcessIdentity(int(table["pid"]), table.get("start")).alive()
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not alive:
            path.unlink(missing_ok=True)
            continue
        for row in table.get("upstreams", []):
            entry = merged.setdefault(row["url"], {"in_flight": 0, "served": 0, "processes": 0, "last_failure": None,
                                                   "error": None, "ejected_until": None, "models": []})
            entry["in_flight"] += int(row.get("in_flight") or 0)
            entry["served"] += int(row.get("served") or 0)
            entry["processes"] += 1
            entry["models"] = row.get("models") or entry["models"]
            if row.get("last_failure") and (entry["last_failure"] or 0) < row["last_failure"]:
                entry["last_failure"], entry["error"] = row["last_failure"], row.get("error")
            if row.get("ejected_until") and row["ejected_until"] > time.time():
                entry["ejected_until"] = max(entry["ejected_until"] or 0, row["ejected_until"])
    return merged
