"""The `ops` command: plan, up, down, status, health, logs."""

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from common import gpu
from common.agent_configs import backups_of, remembered
from common.gpu import fmt
from common.settings import SettingsError
from ops import alerts, engines, lifecycle
from ops.backup import BackupError
from ops.plan import make_plan
from ops.service_needs import with_needs
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
    runner = args.runner or os.environ.get("SCRIPTORIUM_RUNNER", "process")
    services, needs = with_needs(services, devices, runner)
    plan = make_plan(services, devices, running, leases=_leases_on(), runner=runner, needs=needs)
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


def _leases_on() -> bool:
    return os.environ.get("SCRIPTORIUM_LEASES", "1").lower() not in ("0", "false", "no", "off")


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
    from ops.lease_repair import describe

    lease = describe(lifecycle.home())
    from common.settings import Settings
    from ops import upstreams

    llms = upstreams.report(lifecycle.home(), list(Settings.from_env().llm_urls))
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
    for line in upstreams.lines(llms):
        print(line)
    return 0


def _health(args) -> int:
    stack = load(args.file)
    if args.wait:
        ok, detail = lifecycle.wait_healthy(stack, args.wait, args.timeout)
        if not ok:
            print(f"error: {detail}", file=sys.stderr)
        return 0 if ok else 1
    from common.settings import Settings
    from ops.lease_repair import repair

    repaired = repair(lifecycle.home(), Settings.from_env().llm_urls[0])
    report = lifecycle.health_report(stack, args.profile, every=args.all)
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


def _systemd(args) -> int:
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


def _backup_configs(stack) -> list[Path]:
    """compose.yaml, its .env, the settings file, and the backups `mcp_server install` kept of the agent configs
    it changed (it records which in the data directory)."""
    configs = [stack.path, stack.path.parent / ".env",
               Path(os.environ.get("SCRIPTORIUM_CONFIG") or lifecycle.home() / "config.toml")]
    for path in remembered(lifecycle.home()):
        configs += backups_of(path)
    return configs


def _docker_images(stack, backup_id_hint: str):
    """(service, image stream) for each of this project's labelled containers: committed, then saved."""
    import docker

    from ops.runners.docker import LABEL, PROJECT_LABEL, SERVICE_LABEL

    try:
        client = docker.from_env()
        client.ping()
    except Exception:  # noqa: BLE001 no engine: nothing of Docker's to back up
        return []
    streams = []
    for container in client.containers.list(all=True, filters={"label": [f"{LABEL}=1",
                                                                           f"{PROJECT_LABEL}={stack.project}"]}):
        service = container.labels.get(SERVICE_LABEL, container.name)
        image = container.commit(repository=f"scriptorium-backup-{service}", tag=backup_id_hint)

        def stream(image=image):
            try:
                yield from image.save(named=True)
            finally:
                client.images.remove(image.id, force=True)

        streams.append((service, stream()))
    return streams


def _backup(args) -> int:
    from ops import backup, backup_prune

    root = backup.root_for(lifecycle.home(), args.to if args.action != "restore" else args.root)
    if args.action == "create":
        stack = load(args.file)
        made = backup.create(lifecycle.home(), root, _backup_configs(stack), include_models="models" in args.include,
                             docker_images=_docker_images(stack, time.strftime("%Y%m%d-%H%M%S")))
        for skip in made.skipped:  # links, fifos, sockets, devices: never followed nor opened
            print(f"note: not backed up: {skip['path']}: {skip['note']}", file=sys.stderr)
        if args.json:
            print(json.dumps({"id": made.id, "path": str(made.path), "files": len(made.files), "bytes": made.size,
                              "skipped": made.skipped}))
        else:
            print(f"backup {made.id}: {len(made.files)} files, {fmt(made.size)} in {made.path}")
        return 0
    if args.action == "list":
        rows, broken = backup.scan(root)
        if args.json:
            print(json.dumps({"backups": [{"id": b.id, "path": str(b.path), "created": b.created,
                                           "files": len(b.files), "bytes": b.size, "problems": b.problems}
                                          for b in rows],
                              "broken": [{"id": b.id, "path": str(b.path), "problem": b.problem} for b in broken]},
                             indent=2))
        else:
            for b in rows:
                print(f"{b.id}  {time.strftime('%Y-%m-%d %H:%M', time.localtime(b.created))}  "
                      f"{len(b.files):5d} files  {fmt(b.size):>9}"
                      + (f"  {len(b.problems)} bad entries (ops backup verify {b.id})" if b.problems else ""))
            for b in broken:
                print(f"{b.id}  broken: {b.problem}")
            if not rows and not broken:
                print(f"no backups in {root}")
        for b in broken:
            print(f"warning: backup {b.id} is broken: {b.problem} ({b.path})", file=sys.stderr)
        return 0
    if args.action == "verify":
        chosen = backup.find(root, args.id)
        problems = backup.verify(root, chosen)
        for problem in problems:
            print(problem, file=sys.stderr)
        if args.json:
            print(json.dumps({"id": chosen.id, "ok": not problems, "problems": problems}))
        elif not problems:
            print(f"backup {chosen.id}: {len(chosen.files)} files verified")
        return 1 if problems else 0
    if args.action == "prune":
        pruned = backup_prune.prune_report(root, args.keep_last, args.keep_daily, args.keep_weekly)
        for note in pruned.notes:
            print(f"note: {note}", file=sys.stderr)
        print(json.dumps({"removed": pruned.removed, "objects_removed": pruned.objects_removed,
                          "notes": pruned.notes}) if args.json else
              (f"removed {', '.join(pruned.removed)}" if pruned.removed else "nothing to remove"))
        return 0
    if args.id is None:
        raise StackError("restore needs the backup id: ops backup restore ID (see ops backup list)")
    chosen = backup.get(root, args.id)
    written = backup.restore(root, chosen, Path(args.to).expanduser() if args.to else lifecycle.home(), args.force)
    print(json.dumps({"id": chosen.id, "restored": [str(p) for p in written]}) if args.json else
          f"restored {len(written)} files from backup {chosen.id}")
    return 0


def _monitor(args) -> int:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ops", description="Start, watch and stop Scriptorium's services")
    parser.add_argument("--file", "-f", default=None, help="the compose file (default: ./compose.yaml)")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p, services=True):
        if services:
            p.add_argument("services", nargs="*", help="services (default: all in the active profiles)")
        p.add_argument("--profile", action="append", default=[], help="compose profile to include (e.g. image)")
        p.add_argument("--json", action="store_true")

    p = sub.add_parser("plan", help="the start order, GPU budgets and commands, refused when they cannot fit")
    common(p)
    p.add_argument("--runner", choices=["process", "docker"], default=None,
                   help="show the commands of this runner (default: process, or SCRIPTORIUM_RUNNER)")
    p = sub.add_parser("up", help="start services in the memory-safe order and wait until healthy")
    common(p)
    p.add_argument("--runner", choices=["process", "docker"], default=None,
                   help="process (default, or SCRIPTORIUM_RUNNER) or docker")
    p.add_argument("--keep", action="store_true", help="keep what was started when a later service fails")
    common(sub.add_parser("down", help="stop services (reverse order)"))
    common(sub.add_parser("status", help="every service's state"), services=False)
    p = sub.add_parser("health", help="one-shot check: exit 0 when every started service is healthy")
    common(p, services=False)
    p.add_argument("--all", action="store_true", help="check every service of the active profiles, however started")
    p.add_argument("--wait", nargs="+", metavar="SERVICE", help="block until these services are healthy")
    p.add_argument("--timeout", type=float, default=600, help="with --wait: seconds before giving up")
    p.add_argument("--alert", metavar="CMD", help="on failure run CMD (a shell command) with the report on stdin")
    p.add_argument("--webhook", metavar="URL",
                   help="on failure POST the report as JSON to URL (default: $SCRIPTORIUM_ALERT_WEBHOOK)")
    p = sub.add_parser("systemd", help="systemd units (memory-safe order) and health/backup timers")
    p.add_argument("action", choices=["print", "install"])
    common(p)
    p.add_argument("--output", help="with print: write the files into this directory")
    p.add_argument("--user", action="store_true", help="user units (~/.config/systemd/user) instead of system ones")
    p.add_argument("--runner", choices=["process", "docker"], default=None)
    p.add_argument("--alert", metavar="CMD", help="the health timer runs CMD when something fails")
    p.add_argument("--webhook", metavar="URL", help="the health timer POSTs to URL when something fails")
    p = sub.add_parser("backup", help="verified backups: create (default), list, verify, prune, restore")
    p.add_argument("action", nargs="?", default="create", choices=["create", "list", "verify", "prune", "restore"])
    p.add_argument("id", nargs="?", help="the backup (verify: default the newest; restore: required)")
    p.add_argument("--to", help="create/list/verify/prune: the backup directory (default $SCRIPTORIUM_HOME/backups); "
                                "restore: where to restore (default $SCRIPTORIUM_HOME)")
    p.add_argument("--root", help="restore: the backup directory the backup is in")
    p.add_argument("--include", action="append", default=[], choices=["models"], help="also back up the models")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--keep-daily", type=int, default=7)
    p.add_argument("--keep-weekly", type=int, default=4)
    p.add_argument("--force", action="store_true", help="restore: overwrite existing files")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("monitor", help="live GPU memory, temperature and service health")
    p.add_argument("--interval", type=float, default=2.0)
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="with --once: the snapshot as JSON")
    p = sub.add_parser("logs", help="a service's log")
    p.add_argument("service")
    p.add_argument("--follow", "-F", "-f", action="store_true")
    p.add_argument("--lines", type=int, default=50)
    args = parser.parse_args(argv)
    commands = {"plan": _plan, "up": _up, "down": _down, "status": _status, "health": _health, "logs": _logs,
                "systemd": _systemd, "backup": _backup, "monitor": _monitor}
    try:
        return commands[args.command](args)
    except (StackError, BackupError, SettingsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a path ops could not read or write: one line naming it, not a traceback
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
