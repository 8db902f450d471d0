"""`ops backup`: create, list, verify, prune and restore verified backups (ops/backup.py does the work)."""

import json
import os
import sys
import time
from pathlib import Path

from common.agent_configs import backups_of, remembered
from common.gpu import fmt
from ops import lifecycle
from ops.stack import StackError, load


def backup_configs(stack) -> list[Path]:
    """compose.yaml, its .env, the settings file, and the backups `mcp_server install` kept of the agent configs
    it changed (it records which in the data directory)."""
    configs = [stack.path, stack.path.parent / ".env",
               Path(os.environ.get("SCRIPTORIUM_CONFIG") or lifecycle.home() / "config.toml")]
    for path in remembered(lifecycle.home()):
        configs += backups_of(path)
    return configs


def docker_images(stack, backup_id_hint: str):
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


def backup_command(args) -> int:
    from ops import backup, backup_prune

    root = backup.root_for(lifecycle.home(), args.to if args.action != "restore" else args.root)
    if args.action == "create":
        stack = load(args.file)
        made = backup.create(lifecycle.home(), root, backup_configs(stack), include_models="models" in args.include,
                             docker_images=docker_images(stack, time.strftime("%Y%m%d-%H%M%S")))
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
