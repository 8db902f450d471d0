"""The `ops` commands that start, stop and watch the services: plan, up, down, status, health, logs, systemd,
monitor. Each takes the parsed arguments and returns the exit code."""

import json
import os
import shlex
import sys
import time
from pathlib import Path

from common import gpu
from common.gpu import fmt
from ops import alerts, engines, lifecycle
from ops.health_report import health_report
from ops.plan import make_plan
from ops.service_needs import with_needs
from ops.service_records import State
from ops.stack import StackError, load


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


def plan_command(args) -> int:
    stack = load(args.file)
    services = stack.selected(args.services, args.profile)
    state = State(lifecycle.home())
    running = {s.name for s in services if lifecycle.service_status(s, state, stack).state == "healthy"}
    devices, source = gpu.probe()
    runner = args.runner or os.environ.get("SCRIPTORIUM_RUNNER", "process")
    services, needs = with_needs(services, devices, runner)
    plan = make_plan(services, devices, running, leases=leases_on(), runner=runner, needs=needs)
    if args.json:
        print(json.dumps({**plan.to_dict(), "probe": source}, indent=2))
    else:
        where = f"GPU {plan.device.index} {plan.device.name}: {fmt(plan.device.free)} free of " \
                f"{fmt(plan.device.total)}" if plan.device else "no GPU: every service runs on the CPU"
        print(where)
        for i, step in enumerate(plan.steps, 1):
            memory = f"{fmt(step.budget):>9} {step.memory:<7} (free then {fmt(step.free_before)})" \
                if plan.device else "cpu"
            engine = f"  engine {step.engine}, sleep_api {step.sleep_api}" if step.engine else ""
            if step.need is not None:
                engine += f", its largest model needs {fmt(step.need)}"
            print(f"{i}. {step.service:<10} {memory}{engine}{'  already running' if step.running else ''}"
                  f"{'  ' + step.note if step.note else ''}")
            if step.command:
                where = f"docker {step.image}: " if step.runner == "docker" else "$ "
                print(f"   {where}{shlex.join(step.command)}")
    for step in plan.steps:
        if step.missing and not step.running:
            print(f"warning: {step.missing}", file=sys.stderr)
    for problem in plan.problems:
        print(f"error: {problem}", file=sys.stderr)
    return 2 if plan.problems else 0


def leases_on() -> bool:
    return os.environ.get("SCRIPTORIUM_LEASES", "1").lower() not in ("0", "false", "no", "off")


def up_command(args) -> int:
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


def down_command(args) -> int:
    stack = load(args.file)
    stopped = lifecycle.down(stack, args.services, args.profile)
    if args.json:
        print(json.dumps({"stopped": stopped}))
    else:
        print(f"stopped {', '.join(stopped)}" if stopped else "nothing was running")
    return 0


def status_command(args) -> int:
    stack = load(args.file)
    state = State(lifecycle.home())
    rows = [lifecycle.service_status(s, state, stack) for s in stack.services.values()]
    devices, source = gpu.probe()
    from ops.lease_repair import describe

    lease = describe(lifecycle.home())
    from common.settings import Settings
    from ops import upstream_status

    llms = upstream_status.report(lifecycle.home(), list(Settings.from_env().llm_urls))
    if args.json:
        print(json.dumps({"services": [r.__dict__ for r in rows], "lease": lease, "upstreams": llms,
                          "gpu": {"source": source, "devices": [d.to_dict() for d in devices]}}, indent=2))
        return 0
    print(f"{'SERVICE':<10} {'STATE':<10} {'RUNNER':<8} {'PID/CONTAINER':<14} {'GPU MEM':>9}  HEALTH")
    for r in rows:
        ident = str(r.pid or (r.container or "")[:12] or "-")
        mem = fmt(r.gpu_memory_measured) if r.gpu_memory_measured else "-"
        print(f"{r.service:<10} {r.state:<10} {r.runner or '-':<8} {ident:<14} {mem:>9}  {r.health or '-'}")
    for d in devices:
        print(f"GPU {d.index} {d.name}: {fmt(d.free)} free of {fmt(d.total)}")
    if lease:
        since = time.strftime("%H:%M:%S", time.localtime(lease["since"]))
        print(f"the card is lent to ComfyUI since {since} ({lease['jobs']} image job(s) running); the LLM sleeps")
    else:
        print("the card is held by the services as planned (no lease)")
    print()
    for line in upstream_status.lines(llms):
        print(line)
    return 0


def health_command(args) -> int:
    stack = load(args.file)
    if args.wait:
        ok, detail = lifecycle.wait_healthy(stack, args.wait, args.timeout)
        if not ok:
            print(f"error: {detail}", file=sys.stderr)
        return 0 if ok else 1
    from common.settings import Settings
    from ops.lease_repair import repair

    settings = Settings.from_env()
    repaired = repair(lifecycle.home(), settings.llm_urls[0], settings.llm_api_key)
    report = health_report(stack, args.profile, every=args.all)
    if repaired:  # something was wrong, even if it is mended now
        report["problems"] = repaired + report["problems"]
        report["repaired"] = repaired
        report["ok"] = False
    webhook = args.webhook or os.environ.get("SCRIPTORIUM_ALERT_WEBHOOK")  # systemd units pass it this way
    if not report["ok"] and (args.alert or webhook):
        alert_errors = alerts.send(report, args.alert, webhook)
        for error in alert_errors:
            print(f"error: alert not delivered: {error}", file=sys.stderr)
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


def logs_command(args) -> int:
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


def systemd_command(args) -> int:
    from ops import systemd

    stack = load(args.file)
    devices, _ = gpu.probe()
    total = devices[0].total if devices else None
    services = [engines.resolved(s, total) for s in stack.selected(args.services, args.profile)]
    generated = systemd.units(stack, services, args.runner or os.environ.get("SCRIPTORIUM_RUNNER", "process"),
                              user=args.user, gpus=bool(devices), alert=args.alert, webhook=args.webhook)
    secrets = systemd.write_secrets(generated)
    if secrets is not None:
        print(f"secrets for the units ({', '.join(sorted(generated.secrets))}) are in {secrets} (mode 0600)",
              file=sys.stderr)
    files = generated.files
    if args.action == "print":
        if args.output:
            for path in systemd.write(files, Path(args.output)):
                print(path)
        else:
            for name, text in files.items():
                print(f"# --- {name}\n{text}")
        return 0
    paths, notes = systemd.install(files, args.user)
    for path in paths:
        print(path)
    for note in notes:
        print(note, file=sys.stderr)
    return 0


def monitor_command(args) -> int:
    from ops import monitor

    stack = load(args.file)
    if args.once:
        data = monitor.snapshot(stack)
        if args.json:
            print(json.dumps(data, indent=2))
        else:
            from rich.console import Console

            Console().print(monitor.render(data))
        return 0
    monitor.live(stack, args.interval)
    return 0
