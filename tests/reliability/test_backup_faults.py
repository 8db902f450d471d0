"""ops backup and restore under faults: hostile or damaged manifests, symlinks, full disks, crashes midway,
prunes beside a backup being written. The real `ops` command on real files."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ops.conftest import run_ops
from tests.reliability.disk_log import DiskLog

COMPOSE_ENV = {"SCRIPTORIUM_COMPOSE": str(Path(__file__).resolve().parents[2] / "compose.yaml")}


@pytest.fixture
def home(tmp_path):
    home = tmp_path / "home"
    (home / "runs" / "r1").mkdir(parents=True)
    (home / "runs" / "r1" / "article.md").write_text("# An article\n")
    (home / "models").mkdir()
    (home / "models" / "weights.gguf").write_bytes(b"GGUF" + b"\x01" * 4096)
    return home


def make_backup(home, root, models=False) -> dict:
    made = run_ops(home, "backup", "--to", str(root), "--json", *(["--include", "models"] if models else []),
                   env=COMPOSE_ENV)
    assert made.returncode == 0, made.stderr
    return json.loads(made.stdout)


def add_entry(made: dict, entry: dict) -> None:
    manifest_path = Path(made["path"]) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"].append(entry)
    manifest_path.write_text(json.dumps(manifest))


def file_entry(path: str, data: bytes, **extra) -> dict:
    import hashlib

    return {"path": path, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data), **extra}


def everything_under(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*")} if directory.exists() else set()


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "object"])
def test_restore_writes_nothing_for_a_manifest_that_leads_outside_the_target(home, tmp_path, kind):
    root, target = tmp_path / "backups", tmp_path / "restored"
    made = make_backup(home, root, models=True)
    payload = b"planted by a hostile manifest\n"
    if kind == "dotdot":  # the stored file exists and checksums, so only the path itself can be refused
        (root / "escape").mkdir()
        (root / "escape" / "evil.txt").write_bytes(payload)
        add_entry(made, file_entry("../escape/evil.txt", payload))
        victim = tmp_path / "escape" / "evil.txt"
    elif kind == "absolute":
        victim = tmp_path / "abs" / "evil.txt"
        add_entry(made, file_entry(str(victim), payload))
    else:  # an "object" that names a host file instead of a sha256 in the store
        secret = tmp_path / "host-secret.txt"
        secret.write_bytes(payload)
        add_entry(made, file_entry("models/stolen.txt", payload, object=f"../../{secret.name}"))
        victim = target / "models" / "stolen.txt"
    restore = run_ops(home, "backup", "restore", made["id"], "--root", str(root), "--to", str(target),
                      env=COMPOSE_ENV)
    assert not victim.exists() and everything_under(target) == set()
    assert restore.returncode == 2 and "nothing was restored" in restore.stderr and "Traceback" not in restore.stderr
    verify = run_ops(home, "backup", "verify", made["id"], "--to", str(root), env=COMPOSE_ENV)
    assert verify.returncode == 1 and "bad entry" in verify.stderr
    entry = json.loads((Path(made["path"]) / "manifest.json").read_text())["files"][-1]
    assert repr(entry["path"]) in verify.stderr  # the entry is named


def test_restore_refuses_to_follow_a_symlink_out_of_the_target(home, tmp_path):
    root, target, elsewhere = tmp_path / "backups", tmp_path / "restored", tmp_path / "elsewhere"
    made = make_backup(home, root)
    elsewhere.mkdir()
    target.mkdir()
    (target / "runs").symlink_to(elsewhere)
    restore = run_ops(home, "backup", "restore", made["id"], "--root", str(root), "--to", str(target),
                      env=COMPOSE_ENV)
    assert restore.returncode == 2 and "outside" in restore.stderr and "runs/r1/article.md" in restore.stderr
    assert everything_under(elsewhere) == set() and everything_under(target) == {"runs"}


@pytest.mark.parametrize("damage", ['{"id": "x", "files": [', '{"id": "x"}', '{"created": "today", "files": {}}',
                                    "[1, 2]", b"\xff\xfe not utf-8"])
def test_one_unreadable_manifest_breaks_neither_list_nor_verify_nor_prune(home, tmp_path, damage):
    root = tmp_path / "backups"
    first = make_backup(home, root, models=True)  # the only backup with the first model: object A
    (home / "models" / "weights.gguf").write_bytes(b"GGUF" + b"\x02" * 4096)
    second, third = make_backup(home, root, models=True), make_backup(home, root, models=True)  # object B
    manifest = Path(first["path"]) / "manifest.json"
    manifest.write_bytes(damage if isinstance(damage, bytes) else damage.encode())
    listed = run_ops(home, "backup", "list", "--to", str(root), "--json", env=COMPOSE_ENV)
    assert listed.returncode == 0, listed.stderr
    data = json.loads(listed.stdout)
    assert [b["id"] for b in data["backups"]] == [second["id"], third["id"]]
    assert [b["id"] for b in data["broken"]] == [first["id"]] and first["id"] in listed.stderr
    assert run_ops(home, "backup", "verify", second["id"], "--to", str(root), env=COMPOSE_ENV).returncode == 0
    broken = run_ops(home, "backup", "verify", first["id"], "--to", str(root), env=COMPOSE_ENV)
    assert broken.returncode == 1 and str(manifest) in broken.stderr and "Traceback" not in broken.stderr
    restore = run_ops(home, "backup", "restore", first["id"], "--root", str(root), "--to", str(tmp_path / "r"),
                      env=COMPOSE_ENV)
    assert restore.returncode == 2 and "cannot be used" in restore.stderr
    objects = sorted(p.name for p in (root / "objects").iterdir())
    assert len(objects) == 2
    pruned = run_ops(home, "backup", "prune", "--to", str(root), "--keep-last", "1", "--keep-daily", "0",
                     "--keep-weekly", "0", "--json", env=COMPOSE_ENV)
    assert pruned.returncode == 0, pruned.stderr
    assert json.loads(pruned.stdout)["removed"] == [second["id"]]
    assert Path(first["path"]).is_dir()  # never deletes what it cannot read
    assert sorted(p.name for p in (root / "objects").iterdir()) == objects  # nor the objects it might use
    assert run_ops(home, "backup", "verify", third["id"], "--to", str(root), env=COMPOSE_ENV).returncode == 0


def test_a_manifest_with_bad_entry_types_is_listed_and_verify_names_the_entry(home, tmp_path):
    root = tmp_path / "backups"
    made = make_backup(home, root)
    add_entry(made, {"path": "runs/r1/size.txt", "sha256": "0" * 64, "size": "12"})
    add_entry(made, {"path": "runs/r1/upper.txt", "sha256": "A" * 64, "size": 1})
    listed = run_ops(home, "backup", "list", "--to", str(root), env=COMPOSE_ENV)
    assert listed.returncode == 0 and "2 bad entries" in listed.stdout
    verify = run_ops(home, "backup", "verify", "--to", str(root), "--json", env=COMPOSE_ENV)
    problems = json.loads(verify.stdout)["problems"]
    assert verify.returncode == 1 and len(problems) == 2
    assert "'runs/r1/size.txt'" in problems[0] and "size" in problems[0] and "'runs/r1/upper.txt'" in problems[1]


def test_a_backup_and_its_restore_reach_the_disk_before_they_are_visible(home, tmp_path, monkeypatch):
    from ops import backup

    root, target = tmp_path / "backups", tmp_path / "restored"
    disk = DiskLog(monkeypatch)
    made = backup.create(home, root, [], include_models=True)
    partial = root / f".{made.id}.partial"
    shown = disk.index("rename", str(partial), str(made.path))
    for entry in made.files:
        if entry.get("object"):
            assert disk.synced_before_rename(root / "objects" / entry["object"])
            assert disk.renamed_to(root / "objects" / entry["object"]) < shown
        else:
            assert disk.index("fsync", str(partial / entry["path"])) < shown
            assert disk.index("fsync", str(partial / Path(entry["path"]).parent)) < shown
    manifest = disk.renamed_to(partial / "manifest.json")
    assert ("fsync", disk.events[manifest][1]) in disk.events[:manifest] and manifest < shown
    assert ("fsync", str(root)) in disk.events[shown:]
    backup.restore(root, made, target)
    for entry in made.files:
        assert disk.synced_before_rename(target / entry["path"])


def test_backup_to_a_path_under_a_regular_file_is_one_line_and_leaves_nothing(home, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the backups should go\n")
    for args in (["backup"], ["backup", "list"], ["backup", "verify"], ["backup", "prune"]):
        result = run_ops(home, *args, "--to", str(blocker / "backups"), env=COMPOSE_ENV)
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) <= 1, result.stderr
    made = run_ops(home, "backup", "--to", str(blocker / "backups"), env=COMPOSE_ENV)
    assert made.returncode != 0
    assert made.stderr.strip() == f"error: cannot write the backup to {blocker / 'backups'}: Not a directory"
    root = tmp_path / "backups"
    good = make_backup(home, root)
    restore = run_ops(home, "backup", "restore", good["id"], "--root", str(root), "--to", str(blocker / "home"),
                      env=COMPOSE_ENV)
    assert restore.returncode != 0 and "Traceback" not in restore.stderr
    assert str(blocker) in restore.stderr and "Not a directory" in restore.stderr
    assert len(restore.stderr.strip().splitlines()) == 1


def test_a_full_disk_midway_is_one_line_and_the_partial_backup_is_removed(home, tmp_path, monkeypatch, capsys):
    import errno

    from ops import cli

    root = tmp_path / "backups"
    real_fsync = os.fsync

    def full(fd):  # where the filesystem finds out it is full: writeback, reported by fsync
        if os.readlink(f"/proc/self/fd/{fd}").endswith("article.md"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setenv("SCRIPTORIUM_HOME", str(home))
    monkeypatch.setenv("SCRIPTORIUM_COMPOSE", COMPOSE_ENV["SCRIPTORIUM_COMPOSE"])
    monkeypatch.setattr(os, "fsync", full)
    code = cli.main(["backup", "--to", str(root), "--include", "models"])
    err = capsys.readouterr().err
    assert code != 0 and err.strip() == f"error: cannot write the backup to {root}: No space left on device"
    assert [p.name for p in root.iterdir() if not p.name.startswith((".lock", "objects"))] == []
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert cli.main(["backup", "list", "--to", str(root)]) == 0 and "no backups" in capsys.readouterr().out


def test_prune_keeps_the_objects_of_a_backup_still_being_written(home, tmp_path):
    import threading

    from ops import backup

    root = tmp_path / "backups"
    stored, release = threading.Event(), threading.Event()

    def slow_image():  # models are stored by now; the manifest comes after the image
        stored.set()
        release.wait(30)
        yield b"image layer"

    made = []
    writer = threading.Thread(target=lambda: made.append(backup.create(home, root, [], include_models=True,
                                                                       docker_images=[("svc", slow_image())])))
    writer.start()
    try:
        assert stored.wait(30)
        objects = sorted(p.name for p in (root / "objects").iterdir())
        assert objects and not backup.list_backups(root)  # stored, not yet referred to by any manifest
        pruned = run_ops(home, "backup", "prune", "--to", str(root), "--keep-last", "0", "--keep-daily", "0",
                         "--keep-weekly", "0", env=COMPOSE_ENV)
        assert pruned.returncode != 0 and "nothing was pruned" in pruned.stderr
        assert sorted(p.name for p in (root / "objects").iterdir()) == objects
    finally:
        release.set()
        writer.join()
    assert made and backup.verify(root, made[0]) == []


def test_a_backup_that_crashed_midway_does_not_block_prune(home, tmp_path):
    from ops import backup

    root = tmp_path / "backups"
    kept = make_backup(home, root)
    crash = ("import os, signal, sys\nfrom pathlib import Path\nfrom ops import backup\n"
             "def image():\n    yield b'half an image'\n    os.kill(os.getpid(), signal.SIGKILL)\n"
             "backup.create(Path(sys.argv[1]), Path(sys.argv[2]), [], include_models=True, "
             "docker_images=[('svc', image())])\n")
    (home / "models" / "weights.gguf").write_bytes(b"GGUF" + b"\x03" * 4096)  # an object only the crash stored
    died = subprocess.run([sys.executable, "-c", crash, str(home), str(root)], cwd=Path(__file__).parents[2])
    assert died.returncode == -signal.SIGKILL
    assert [p for p in root.iterdir() if p.name.endswith(".partial")] and list((root / "objects").iterdir())
    (root / "lost+found").mkdir()  # not a backup: neither broken nor in the way
    pruned = run_ops(home, "backup", "prune", "--to", str(root), env=COMPOSE_ENV)  # the flock died with it
    assert pruned.returncode == 0, pruned.stderr
    assert sorted(p.name for p in root.iterdir()) == sorted([".lock", "objects", "lost+found", kept["id"]])
    assert list((root / "objects").iterdir()) == []  # nothing refers to what the dead backup stored
    assert backup.verify(root, backup.get(root, kept["id"])) == []
