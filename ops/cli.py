"""The `ops` command: plan, up, down, status, health, logs."""

import argparse
import json
import os
import sys
import time

from ops import gpu, lifecycle
from ops.gpu import fmt
from ops.plan import make_plan
from ops.stack import StackError, load
from ops.state import State


class ConsoleReporter(lifecycle.Reporter):
    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.last = 0.0

    def step(self, service: str, text: str) -> None:
        if not self.quiet:
            print(f"{service:<10} {text}", file=sys.stderr, flush=True)

    def waiting(self, service: str, elapsed: float, timeout: float) -> None:
        if not self.quiet and sys.stderr.isatty() and time.monotonic() - self.last > 0.5:
            self.last = time.monotonic()
            print(f"\r{service:<10} waiting for health {elapsed:5.0f}s / {timeout:.0f}s", end="", file=sys.stderr,
                  flush=True)


def _plan(args) -> int:
    stack = load(args.file)
    services = stack.selected(args.services, args.profile)
    state = State(lifecycle.home())
    running = {s.name for s in services if lifecycle.service_status(s, state, stack).state == "healthy"}
    devices, source = gpu.probe()
    plan = make_plan(services, devices, running)
    if args.json:
        print(json.dumps({**plan.to_dict(), "probe": source}, indent=2))
    else:
        where = f"GPU {plan.device.index} {plan.device.name}: {fmt(plan.device.free)} free of " \
                f"{fmt(plan.device.total)}" if plan.device else "no GPU: every service runs on the CPU"
        print(where)
        for i, step in enumerate(plan.steps, 1):
            memory = f"{fmt(step.budget):>9} {step.memory:<7} (free then {fmt(step.free_before)})" \
                if plan.device else "cpu"
            print(f"{i}. {step.service:<10} {memory}{'  already running' if step.running else ''}")
    for problem in plan.problems:
        print(f"error: {problem}", file=sys.stderr)
    return 2 if plan.problems else 0


def _up(args) -> int:
    stack = load(args.file)
    runner = args.runner or os.environ.get("SCRIPTORIUM_RUNNER", "process")
    result = lifecycle.up(stack, args.services, args.profile, runner, keep=args.keep,
                          reporter=ConsoleReporter(args.json))
    if args.json:
        print(json.dumps({"ok": result.failed is None, "started": result.started, "already": result.already,
                          "failed": result.failed, "message": result.message, "log_tail": result.log_tail}))
    if result.failed == "plan":
        for line in result.message.splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    if result.failed:
        if not args.json:
            print(f"error: {result.message}", file=sys.stderr)
            if result.log_tail:
                print(f"--- last lines of {result.failed}'s log ---\n{result.log_tail.rstrip()}", file=sys.stderr)
        return 1
    if not args.json:
        mcp = stack.services.get("mcp")
        if mcp is not None and mcp.health:
            url = mcp.health.rsplit("/health", 1)[0] + "/mcp"
            print(f"stack is up. Register it with your agent, e.g.:\n"
                  f"  python -m mcp_server install --client claude-code --http {url}\n"
                  f"  (clients: claude-desktop, claude-code, cursor, vscode, codex, hermes, goose)")
        else:
            print("stack is up")
    return 0


def _down(args) -> int:
    stack = load(args.file)
    stopped = lifecycle.down(stack, args.services, args.profile)
    if args.json:
        print(json.dumps({"stopped": stopped}))
    else:
        print(f"stopped {', '.join(stopped)}" if stopped else "nothing was running")
    return 0


def _status(args) -> int:
    stack = load(args.file)
    state = State(lifecycle.home())
    rows = [lifecycle.service_status(s, state, stack) for s in stack.services.values()]
    devices, source = gpu.probe()
    if args.json:
        print(json.dumps({"services": [r.__dict__ for r in rows], "gpu": {"source": source,
                                                                         "devices": [d.to_dict() for d in devices]}},
                         indent=2))
        return 0
    print(f"{'SERVICE':<10} {'STATE':<10} {'RUNNER':<8} {'PID/CONTAINER':<14} {'GPU MEM':>9}  HEALTH")
    for r in rows:
        ident = str(r.pid or (r.container or "")[:12] or "-")
        mem = fmt(r.gpu_memory_measured) if r.gpu_memory_measured else "-"
        print(f"{r.service:<10} {r.state:<10} {r.runner or '-':<8} {ident:<14} {mem:>9}  {r.health or '-'}")
    for d in devices:
        print(f"GPU {d.index} {d.name}: {fmt(d.free)} free of {fmt(d.total)}")
    return 0


def _health(args) -> int:
    report = lifecycle.health_report(load(args.file), args.profile)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for s in report["services"]:
            print(f"{s['service']:<10} {s['state']:<10} {s['detail']}")
        for d in report["gpu"]["devices"]:
            print(f"GPU {d['index']}: {fmt(d['free'])} free of {fmt(d['total'])}")
        print(f"disk: {fmt(report['disk']['free'])} free at {report['disk']['path']}")
        for p in report["problems"]:
            print(f"problem: {p}", file=sys.stderr)
    return 0 if report["ok"] else 1


def _logs(args) -> int:
    stack = load(args.file)
    if args.service not in stack.services:
        raise StackError(f"unknown service {args.service!r}; the stack has {', '.join(stack.services)}")
    state = State(lifecycle.home())
    record = state.get(args.service)
    if record is None:
        raise StackError(f"{args.service} is not running under ops (start it with `ops up {args.service}`)")
    runner = lifecycle.runner_of(record, state, stack)
    print(runner.log_tail(record, args.lines), end="")
    if args.follow:
        for line in runner.follow(record):
            print(line, end="", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ops", description="Start, watch and stop Scriptorium's services")
    parser.add_argument("--file", "-f", default=None, help="the compose file (default: ./compose.yaml)")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p, services=True):
        if services:
            p.add_argument("services", nargs="*", help="services (default: all in the active profiles)")
        p.add_argument("--profile", action="append", default=[], help="compose profile to include (e.g. image)")
        p.add_argument("--json", action="store_true")

    common(sub.add_parser("plan", help="the start order and GPU budgets, refused when they cannot fit"))
    p = sub.add_parser("up", help="start services in the memory-safe order and wait until healthy")
    common(p)
    p.add_argument("--runner", choices=["process", "docker"], default=None,
                   help="process (default, or SCRIPTORIUM_RUNNER) or docker")
    p.add_argument("--keep", action="store_true", help="keep what was started when a later service fails")
    common(sub.add_parser("down", help="stop services (reverse order)"))
    common(sub.add_parser("status", help="every service's state"), services=False)
    common(sub.add_parser("health", help="one-shot check: exit 0 when every started service is healthy"),
           services=False)
    p = sub.add_parser("logs", help="a service's log")
    p.add_argument("service")
    p.add_argument("--follow", "-F", "-f", action="store_true")
    p.add_argument("--lines", type=int, default=50)
    args = parser.parse_args(argv)
    commands = {"plan": _plan, "up": _up, "down": _down, "status": _status, "health": _health, "logs": _logs}
    try:
        return commands[args.command](args)
    except StackError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
