"""The `ops` command: its arguments, and each command's errors as one line and an exit code. The commands
themselves: ops/service_commands.py (plan, up, down, status, health, logs, systemd, monitor) and
ops/backup_commands.py (backup)."""

import argparse
import sys

from common.settings import SettingsError
from ops import backup_commands, service_commands
from ops.backup import BackupError
from ops.stack import StackError


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
    commands = {name: getattr(service_commands, f"{name}_command") for name in
                ("plan", "up", "down", "status", "health", "logs", "systemd", "monitor")}
    commands["backup"] = backup_commands.backup_command
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


if __name__ == "__main__":
    sys.exit(main())
