"""What `ops health` reports: each service's state, when a failing one started failing (kept across checks),
GPU headroom and free disk."""

import json
import shutil
import time
from pathlib import Path

from common import gpu
from common.files import atomic_write_text
from ops.health import check
from ops.lifecycle import ServiceStatus, home, service_status
from ops.service_records import State
from ops.stack import Stack


def health_report(stack: Stack, profiles: list[str], every: bool = False) -> dict:
    """What `ops health` prints: the services ops started (or, with every, all in the active profiles,
    however they were started: systemd, compose), GPU headroom and free disk; ok when all are healthy."""
    state = State(home())
    if every:
        services = stack.selected(None, profiles)
    else:
        started = {r.service for r in state.all()}
        services = [s for s in stack.services.values() if s.name in started]
    statuses = []
    for s in services:
        if state.get(s.name) is None:  # not ours to track (systemd or compose started it): ask its health URL
            ok, detail = check(s.health)
            statuses.append(ServiceStatus(s.name, None, "healthy" if ok else "unhealthy", health=s.health,
                                          detail=detail))
        else:
            statuses.append(service_status(s, state, stack))
    devices, source = gpu.probe()
    disk = shutil.disk_usage(home() if home().exists() else Path.home())
    problems = [f"{s.service} is {s.state}: {s.detail}" for s in statuses if s.state != "healthy"]
    if not services:
        problems.append("no service is running; start the stack with `ops up`")
    since = _failing_since(state, {s.service for s in statuses if s.state != "healthy"})
    for s in statuses:
        s.since = since.get(s.service, s.since) if s.state != "healthy" else s.since
    return {
        "ok": not problems,
        "problems": problems,
        "services": [s.__dict__ for s in statuses],
        "failing_since": since,
        "gpu": {"source": source, "devices": [d.to_dict() for d in devices]},
        "disk": {"path": str(home()), "free": disk.free, "total": disk.total},
    }


def _failing_since(state: State, failing: set[str]) -> dict[str, float]:
    """When each failing service was first seen failing (kept across checks in state/health/failing.json,
    apart from the per-service records)."""
    path = state.dir / "health" / "failing.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    current = {name: known.get(name, time.time()) for name in failing}
    if current != known:
        atomic_write_text(path, json.dumps(current))
    return current
