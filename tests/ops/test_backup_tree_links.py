"""The backups' own tree never leads outside it: a link planted where the backup code keeps a directory, a
backup, its lock or a stored file is refused or removed itself, never followed, by every `ops backup` command.
Real files, real links, the real `ops` command."""

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from ops import backup
from tests.backend.server_process import ROOT
from tests.ops.backup_victim import OLD_ID, everything, leaks, make_victim
from tests.ops.conftest import run_ops

ENV = {"SCRIPTORIUM_COMPOSE": str(ROOT / "compose.yaml")}
KEEP_NONE = ("--keep-last", "0", "--keep-daily", "0", "--keep-weekly", "0")


@pytest.fixture
def world(tmp_path):
    """A data directory, two real backups of it (models included), and a victim folder outside both."""
    home, root = tmp_path / "home", tmp_path / "backups"
    (home / "runs" / "r1").mkdir(parents=True)
    (home / "runs" / "r1" / "article.md").write_text("# An article\n")
    (home / "models").mkdir()
    (home / "models" / "weights.gguf").write_bytes(b"GGUF" + b"\x01" * 4096)
    made = [backup.create(home, root, [], include_models=True) for _ in range(2)]
    return home, root, made, make_victim(tmp_path / "victim")


def ops(home, *args):
    result = run_ops(home, "backup", *map(str, args), env=ENV, timeout=120)
    assert "Traceback" not in result.stderr, result.stderr
    return result


def test_prune_refuses_an_objects_folder_that_is_a_link_and_deletes_nothing(world):
    home, root, made, victim = world
    before = everything(victim)
    shutil.rmtree(root / "objects")
    (root / "objects").symlink_to(victim)
    pruned = ops(home, "prune", "--to", root, "--keep-last", "1", "--keep-daily", "0", "--keep-weekly", "0")
    assert pruned.returncode == 2 and len(pruned.stderr.strip().splitlines()) == 1
    assert f"{root / 'objects'} is a symbolic link" in pruned.stderr and "nothing was pruned" in pruned.stderr
    assert everything(victim) == before
    assert sorted(b.id for b in backup.list_backups(root)) == [b.id for b in made]


def test_a_backup_id_that_is_a_link_is_kept_as_broken_and_never_followed(world, tmp_path):
    home, root, made, victim = world
    before = everything(victim)
    (root / OLD_ID).symlink_to(victim)  # looks like the oldest backup, one that checks out
    (root / f".{OLD_ID}.deleting").symlink_to(victim / "sub")  # what an earlier prune left behind
    listed = json.loads(ops(home, "list", "--to", root, "--json").stdout)
    assert [b["id"] for b in listed["broken"]] == [OLD_ID] and "symbolic link" in listed["broken"][0][
        "problem"
    ]
    verified = ops(home, "verify", OLD_ID, "--to", root)
    assert verified.returncode == 1 and "symbolic link" in verified.stderr
    restored = ops(home, "restore", OLD_ID, "--root", root, "--to", tmp_path / "restored")
    assert restored.returncode == 2 and "cannot be used" in restored.stderr
    pruned = ops(
        home, "prune", "--to", root, "--keep-last", "1", "--keep-daily", "0", "--keep-weekly", "0", "--json"
    )
    assert pruned.returncode == 0, pruned.stderr
    report = json.loads(pruned.stdout)
    assert report["removed"] == [made[0].id] and any(OLD_ID in note for note in report["notes"])
    assert (root / OLD_ID).is_symlink() and not [p for p in os.listdir(root) if p.endswith(".deleting")]
    assert everything(victim) == before and leaks(tmp_path / "restored") == []


@pytest.mark.parametrize("command", ["create", "verify", "prune", "restore"])
def test_a_lock_that_is_a_link_is_refused_by_name_and_its_target_never_made(world, tmp_path, command):
    home, root, made, victim = world
    before = everything(victim)
    (root / ".lock").unlink()
    (root / ".lock").symlink_to(victim / "made-by-lock")
    args = {
        "create": ["--to", root],
        "verify": ["verify", "--to", root],
        "prune": ["prune", "--to", root],
        "restore": ["restore", made[0].id, "--root", root, "--to", tmp_path / "restored"],
    }[command]
    result = run_ops(home, "backup", *map(str, args), env=ENV, timeout=120)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"{root / '.lock'} is a symbolic link" in result.stderr
    assert everything(victim) == before and not os.path.lexists(victim / "made-by-lock")


def test_a_partial_backup_swapped_for_a_link_midway_fails_and_writes_nothing_outside(world, tmp_path):
    home, root, _, victim = world
    before = everything(victim)

    def image():  # runs once the backup's files are copied, before its manifest is written
        (partial,) = [p for p in root.iterdir() if p.name.endswith(".partial")]
        partial.rename(tmp_path / "moved-away")
        partial.symlink_to(victim)
        yield b"image layer"

    with pytest.raises(backup.BackupError, match="changed under it"):
        backup.create(home, root, [], docker_images=[("svc", image())])
    assert everything(victim) == before
    assert not [p for p in root.iterdir() if p.is_symlink()]  # the link itself is removed, never followed


def plant(kind: str, root: Path, made: list, victim: Path, targets: Path) -> None:
    stored = root / made[0].id
    if kind == "objects":
        shutil.rmtree(root / "objects")
        (root / "objects").symlink_to(victim)
    elif kind == "backup-id":
        (root / OLD_ID).symlink_to(victim)
    elif kind == "lock":
        (root / ".lock").unlink()
        (root / ".lock").symlink_to(victim / "made-by-lock")
    elif kind == "manifest":
        (stored / "manifest.json").unlink()
        (stored / "manifest.json").symlink_to(victim / "manifest.json")
    elif kind == "stored-file":
        (stored / "runs" / "r1" / "article.md").unlink()
        (stored / "runs" / "r1" / "article.md").symlink_to(victim / "notes.txt")
    elif kind == "leftovers":
        (root / ".20200101-000000-001.partial").symlink_to(victim)
        (root / ".20200101-000000-002.deleting").symlink_to(victim / "sub")
    elif kind == "object-entries":
        (root / "objects" / ("0" * 64)).symlink_to(victim / "notes.txt")
        (root / "objects" / "folder").symlink_to(victim)
    else:  # "restore-target": each restore's target holds a link out
        for b in made:
            (targets / b.id).mkdir(parents=True)
            (targets / b.id / "runs").symlink_to(victim)


@pytest.mark.parametrize(
    "kind",
    [
        "objects",
        "backup-id",
        "lock",
        "manifest",
        "stored-file",
        "leftovers",
        "object-entries",
        "restore-target",
    ],
)
def test_no_backup_command_changes_or_reads_anything_outside_through_a_planted_link(world, tmp_path, kind):
    home, root, made, victim = world
    targets = tmp_path / "targets"
    plant(kind, root, made, victim, targets)
    before = everything(victim)
    ids = sorted(name for name in os.listdir(root) if re.fullmatch(r"\d{8}-\d{6}-\d{3}", name))
    commands = [
        ["--to", root, "--include", "models"],
        ["list", "--to", root],
        *(["verify", i, "--to", root] for i in ids),
        *(["restore", i, "--root", root, "--to", targets / i] for i in ids),
        ["prune", "--to", root, *KEEP_NONE],
        ["list", "--to", root],
    ]
    for args in commands:
        result = ops(home, *args)
        assert everything(victim) == before, (args, result.stderr)
    assert leaks(root) == [] and leaks(targets) == []  # nothing of the victim's was read into either
