"""up, down, status and waiting for health over a stack: what the `ops` commands do, as functions (the
`ops health` report: ops/health_report.py)."""

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import gpu
from common.paths import data_home
from ops import engines
from ops.health import check
from ops.plan import Plan, make_plan, order
from ops.runners.process import ProcessRunner
from ops.service_needs import with_needs
from ops.service_records import Record, State
from ops.stack import Service, Stack, StackError


def home() -> Path:
    return data_home()


def runner_for(kind: str, state: State, stack: Stack):
    if kind == "process":
        return ProcessRunner(state)
    if kind == "docker":
        from ops.runners.docker import DockerRunner

        devices, _ = gpu.probe()
        return DockerRunner(state, stack.project, stack.path.parent, gpus=bool(devices))
    raise StackError(f"unknown runner {kind!r}; use process or docker")


def runner_of(record: Record, state: State, stack: Stack):
    return runner_for(record.runner, state, stack)


@dataclass
class ServiceStatus:
    service: str
    runner: str | None
    state: str  # stopped | starting | healthy | unhealthy | dead
    pid: int | None = None
    container: str | None = None
    health: str | None = None
    detail: str = ""
    gpu_memory_measured: int | None = None
    since: float | None = None


def probe_health(url: str | None, runner, record: Record) -> tuple[bool, str]:
    """A service's health: its x-ops health URL; else, in Docker, the container's own healthcheck."""
    if url:
        return check(url)
    if runner.name == "docker":
        status = runner.container_health(record)
        if status is not None:
            return status == "healthy", f"container health: {status}"
    return runner.alive(record), "running (no health check defined)"


def service_status(service: Service, state: State, stack: Stack) -> ServiceStatus:
    record = state.get(service.name)
    if record is None:
        return ServiceStatus(service.name, None, "stopped", health=service.health)
    runner = runner_of(record, state, stack)
    base = dict(runner=record.runner, pid=record.pid, container=record.container, health=record.health,
                gpu_memory_measured=record.gpu_memory_measured, since=record.started)
    if not runner.alive(record):
        return ServiceStatus(service.name, state="dead", detail="its process is gone (crashed or killed)", **base)
    ok, detail = probe_health(record.health, runner, record)
    return ServiceStatus(service.name, state="healthy" if ok else "unhealthy", detail=detail, **base)


@dataclass
class UpResult:
    started: list[str] = field(default_factory=list)
    already: list[str] = field(default_factory=list)
    failed: str | None = None
    message: str = ""
    log_tail: str = ""
    plan: Plan | None = None


class Reporter:
    def step(self, service: str, text: str) -> None: ...

    def waiting(self, service: str, elapsed: float, timeout: float) -> None: ...


def up(stack: Stack, names: list[str] | None, profiles: list[str], runner_kind: str, keep: bool = False,
       reporter: Reporter | None = None) -> UpResult:
    reporter = reporter or Reporter()
    state = State(home())
    services = stack.selected(names, profiles)
    statuses = {s.name: service_status(s, state, stack) for s in services}
    running = {n for n, st in statuses.items() if st.state == "healthy"}
    devices, _ = gpu.probe()
    leases = os.environ.get("SCRIPTORIUM_LEASES", "1").lower() not in ("0", "false", "no", "off")
    # A budget measured from the models (gpu_memory: auto) needs them fetched first.
    early = [s for s in services if s.gpu_memory == "auto" and devices and s.name not in running]
    for s in early:
        try:
            _prepare(s, reporter)
        except StackError as e:
            return UpResult(failed=s.name, message=str(e))
    services, needs = with_needs(services, devices, runner_kind)
    plan = make_plan(services, devices, running, leases=leases, runner=runner_kind, needs=needs)
    result = UpResult(plan=plan)
    if plan.problems:
        result.failed = "plan"
        result.message = "\n".join(plan.problems)
        return result
    total = devices[0].total if devices else None
    by_name = {s.name: engines.resolved(s, total) for s in services}  # budgets in each engine's own terms
    started_now: list[tuple[Record, object, Service]] = []
    for step in plan.steps:
        service = by_name[step.service]
        if step.running:
            result.already.append(service.name)
            reporter.step(service.name, "already healthy")
            continue
        stale = state.get(service.name)
        if stale is not None:  # dead or unhealthy: clear it before starting again
            runner_of(stale, state, stack).stop(stale, service.stop_timeout)
        try:
            if runner_kind == "process" and step.missing:
                raise StackError(step.missing)
            if service.name not in {s.name for s in early}:
                _prepare(service, reporter)
            runner = runner_for(runner_kind, state, stack)
            free_before = _free(devices)
            record = runner.start(service)
            started_now.append((record, runner, service))
            reporter.step(service.name, f"started ({runner_kind})")
            problem = _wait_healthy(service, record, runner, reporter)
        except StackError as e:
            problem = str(e)
            record, runner = state.get(service.name), None
        if problem:
            result.failed = service.name
            result.message = problem
            if record is not None and runner is not None:
                result.log_tail = runner.log_tail(record)
            if not keep:
                for rec, run, svc in reversed(started_now):
                    run.stop(rec, svc.stop_timeout)
            return result
        record.gpu_memory_measured = _measured(record, free_before)
        state.put(record)
        result.started.append(service.name)
        reporter.step(service.name, "healthy")
    return result


def _prepare(service: Service, reporter: Reporter) -> None:
    for command in service.prepare:
        reporter.step(service.name, "preparing: " + " ".join(command))
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise StackError(f"{service.name}: preparing ({' '.join(command)}) failed: "
                             f"{(done.stderr or done.stdout).strip()[-400:]}")


def _wait_healthy(service: Service, record: Record, runner, reporter: Reporter) -> str | None:
    started = time.monotonic()
    while True:
        elapsed = time.monotonic() - started
        if not runner.alive(record):
            return f"{service.name} exited before it became healthy"
        ok, detail = probe_health(service.health, runner, record)
        if ok:
            return None
        if elapsed > service.health_timeout:
            return f"{service.name} was not healthy after {service.health_timeout:.0f} s ({detail})"
        reporter.waiting(service.name, elapsed, service.health_timeout)
        time.sleep(0.25)


def _free(devices) -> int | None:
    return devices[0].free if devices else None


def _measured(record: Record, free_before: int | None) -> int | None:
    if free_before is None:
        return None
    devices, _ = gpu.probe()
    if not devices:
        return None
    if record.pid:
        pids = _process_tree(record.pid)
        used = sum(p.used for p in devices[0].processes if p.pid in pids)
        if used:
            return used
    return max(free_before - devices[0].free, 0)


def _process_tree(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().split(") ")[-1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    tree, queue = set(), [root]
    while queue:
        pid = queue.pop()
        if pid not in tree:
            tree.add(pid)
            queue += children.get(pid, [])
    return tree


def down(stack: Stack, names: list[str] | None, profiles: list[str]) -> list[str]:
    """Stop services in reverse start order; returns the names stopped."""
    state = State(home())
    if names:
        services = [stack.services[n] for n in names if n in stack.services]
        unknown = [n for n in names if n not in stack.services]
        if unknown:
            raise StackError(f"unknown service(s) {', '.join(unknown)}; the stack has {', '.join(stack.services)}")
    else:
        services = list(stack.services.values())
    stopped = []
    for service in reversed(order(services)):
        record = state.get(service.name)
        if record is None:
            continue
        runner_of(record, state, stack).stop(record, service.stop_timeout)
        stopped.append(service.name)
    return stopped


def wait_healthy(stack: Stack, names: list[str], timeout: float) -> tuple[bool, str]:
    """Block until every named service's health URL answers (systemd's ExecStartPost uses this)."""
    services = stack.selected(names, [])
    deadline = time.monotonic() + timeout
    while True:
        waiting = [(s.name, check(s.health)) for s in services if s.name in names]
        bad = [(name, detail) for name, (ok, detail) in waiting if not ok]
        if not bad:
            return True, "healthy"
        if time.monotonic() > deadline:
            return False, "; ".join(f"{name} not healthy after {timeout:.0f} s ({detail})" for name, detail in bad)
        time.sleep(0.5)
