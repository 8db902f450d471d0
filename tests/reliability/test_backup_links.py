"""Backups never follow links: what a link, a hard link or a special file under the data directory points at
never enters a backup, and a restore writes only regular files and directories inside its target. Real files,
the real `ops` command."""

import json
import os
import socket
import stat
from pathlib import Path

import pytest

from tests.ops.conftest import run_ops

COMPOSE_ENV = {"SCRIPTORIUM_COMPOSE": str(Path(__file__).resolve().parents[2] / "compose.yaml")}
SECRET = b"root's secret, mode 0600, outside SCRIPTORIUM_HOME\n"


def everything(directory: Path) -> dict[str, bytes | None]:
    """Every path under directory (links not followed) -> its bytes if it is a regular file."""
    found = {}
    for path in directory.rglob("*"):
        mode = path.lstat().st_mode
        found[str(path.relative_to(directory))] = path.read_bytes() if stat.S_ISREG(mode) else None
    return found


def leaks(directory: Path) -> list[str]:
    return [p for p, data in everything(directory).items() if data is not None and SECRET in data]


@pytest.fixture
def world(tmp_path):
    """A data directory whose runs/ holds, beside a real article, a symlink and a hard link to 0600 files outside
    it, a symlink to a directory outside, a dangling link, a fifo and a socket."""
    home, outside = tmp_path / "home", tmp_path / "outside"
    run = home / "runs" / "r1"
    run.mkdir(parents=True)
    outside.mkdir()
    (run / "article.md").write_text("# An article\n")
    for name in ("secret.txt", "hard-secret.txt", "dir/secret.txt"):
        (outside / name).parent.mkdir(exist_ok=True)
        (outside / name).write_bytes(SECRET)
        (outside / name).chmod(0o600)
    (run / "leak.md").symlink_to(outside / "secret.txt")
    os.link(outside / "hard-secret.txt", run / "hard.md")
    (run / "images").symlink_to(outside / "dir")
    (run / "dangling.md").symlink_to(outside / "gone.md")
    os.mkfifo(run / "pipe")
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(run / "sock"))
    except OSError:  # a path too long for a socket address on this machine: the fifo stands for both
        sock.close()
        sock = None
    # Two names for one file, both inside runs/, are not a leak: both are copied.
    (home / "runs" / "r2").mkdir()
    (home / "runs" / "r2" / "shared.png").write_bytes(b"png bytes")
    os.link(home / "runs" / "r2" / "shared.png", home / "runs" / "r2" / "also.png")
    yield home, outside, sock is not None
    if sock:
        sock.close()


def backup(home: Path, root: Path) -> tuple[dict, str]:
    made = run_ops(home, "backup", "--to", str(root), "--json", env=COMPOSE_ENV, timeout=120)
    assert made.returncode == 0, made.stderr
    return json.loads(made.stdout), made.stderr


def test_links_and_special_files_are_skipped_with_a_note_and_never_copied_nor_restored(world, tmp_path):
    home, outside, has_socket = world
    root, target = tmp_path / "backups", tmp_path / "restored"
    made, stderr = backup(home, root)
    stored = json.loads((Path(made["path"]) / "manifest.json").read_text())
    assert {f["path"] for f in stored["files"] if f["path"].startswith("runs/")} == {
        "runs/r1/article.md", "runs/r2/shared.png", "runs/r2/also.png"}
    notes = {s["path"]: s["note"] for s in stored["skipped"]}
    assert made["skipped"] == stored["skipped"]
    assert "symbolic link" in notes["runs/r1/leak.md"] and "symbolic link" in notes["runs/r1/images"]
    assert "symbolic link" in notes["runs/r1/dangling.md"]
    assert "hard links" in notes["runs/r1/hard.md"] and "outside runs/" in notes["runs/r1/hard.md"]
    assert "fifo" in notes["runs/r1/pipe"]
    if has_socket:
        assert "socket" in notes["runs/r1/sock"]
    for path in notes:
        assert f"note: not backed up: {path}:" in stderr  # the person is told, not only the manifest
    assert leaks(root) == []
    assert all(not p.is_symlink() for p in root.rglob("*"))

    assert run_ops(home, "backup", "verify", "--to", str(root), env=COMPOSE_ENV).returncode == 0
    restored = run_ops(home, "backup", "restore", made["id"], "--root", str(root), "--to", str(target),
                       env=COMPOSE_ENV)
    assert restored.returncode == 0, restored.stderr
    assert leaks(target) == [] and all(not p.is_symlink() for p in target.rglob("*"))
    files = everything(target)
    assert files["runs/r1/article.md"] == b"# An article\n" and files["runs/r2/also.png"] == b"png bytes"
    assert not {"runs/r1/leak.md", "runs/r1/hard.md", "runs/r1/images", "runs/r1/pipe"} & set(files)
    assert all(stat.S_ISREG(p.lstat().st_mode) or p.is_dir() for p in target.rglob("*"))
    assert (outside / "secret.txt").read_bytes() == SECRET  # untouched


def test_a_runs_folder_that_is_itself_a_link_is_not_followed(tmp_path):
    home, outside = tmp_path / "home", tmp_path / "outside"
    home.mkdir()
    outside.mkdir()
    (outside / "secret.txt").write_bytes(SECRET)
    (home / "runs").symlink_to(outside)
    made, stderr = backup(home, tmp_path / "backups")
    assert "note: not backed up: runs: a symbolic link" in stderr
    assert leaks(tmp_path / "backups") == []


def stored_file(made: dict, path: str = "runs/r1/article.md") -> Path:
    return Path(made["path"]) / path


def assert_refused(home: Path, root: Path, made: dict, target: Path, expected: str, force: bool = False):
    """The restore into target is refused, saying `expected`, and leaves target as it was (or absent)."""
    before = everything(target) if target.exists() else None
    result = run_ops(home, "backup", "restore", made["id"], "--root", str(root), "--to", str(target),
                     *(["--force"] if force else []), env=COMPOSE_ENV, timeout=60)
    assert result.returncode == 2 and "nothing was restored" in result.stderr and "Traceback" not in result.stderr
    assert expected in result.stderr, result.stderr
    assert (everything(target) if target.exists() else None) == before
    return result


@pytest.fixture
def plain(tmp_path):
    home = tmp_path / "home"
    (home / "runs" / "r1").mkdir(parents=True)
    (home / "runs" / "r1" / "article.md").write_text("# An article\n")
    root = tmp_path / "backups"
    made, _ = backup(home, root)
    return home, root, made


def test_verify_flags_a_stored_file_hard_linked_elsewhere_and_restore_refuses_it(plain, tmp_path):
    home, root, made = plain
    target = tmp_path / "restored"
    os.link(stored_file(made), tmp_path / "another-name.md")  # the bytes still match the manifest
    verify = run_ops(home, "backup", "verify", "--to", str(root), env=COMPOSE_ENV)
    assert verify.returncode == 1 and "linked: runs/r1/article.md" in verify.stderr and "2 hard links" in verify.stderr
    assert_refused(home, root, made, target, "linked: runs/r1/article.md")


@pytest.mark.parametrize("kind", ["file-link", "dir-link", "fifo"])
def test_a_crafted_backup_whose_stored_entry_is_a_link_or_a_fifo_is_refused(plain, tmp_path, kind):
    home, root, made = plain
    target, elsewhere = tmp_path / "restored", tmp_path / "elsewhere"
    stored = stored_file(made)
    data = stored.read_bytes()
    (elsewhere / "r1").mkdir(parents=True)
    (elsewhere / "r1" / "article.md").write_bytes(data)  # same bytes: only the link itself can be refused
    if kind == "file-link":
        stored.unlink()
        stored.symlink_to(elsewhere / "r1" / "article.md")
    elif kind == "dir-link":
        stored.unlink()
        stored.parent.rmdir()
        stored.parent.symlink_to(elsewhere / "r1")
    else:
        stored.unlink()
        os.mkfifo(stored)  # opening it would hang verify: it must be named without being opened
    verify = run_ops(home, "backup", "verify", "--to", str(root), env=COMPOSE_ENV, timeout=60)
    assert verify.returncode == 1 and "unsafe: runs/r1/article.md" in verify.stderr
    assert ("fifo" if kind == "fifo" else "symbolic link") in verify.stderr
    assert_refused(home, root, made, target, "unsafe: runs/r1/article.md")


@pytest.mark.parametrize("where", ["file", "dir-inside", "dir-outside"])
def test_restore_never_writes_through_a_link_in_the_target_even_with_force(plain, tmp_path, where):
    home, root, made = plain
    target, outside = tmp_path / "restored", tmp_path / "outside"
    (target / "runs").mkdir(parents=True)
    outside.mkdir()
    (outside / "victim.md").write_bytes(SECRET)
    if where == "file":
        (target / "runs" / "r1").mkdir()
        (target / "runs" / "r1" / "article.md").symlink_to(outside / "victim.md")
        expected = "runs/r1/article.md is a symbolic link"
    elif where == "dir-inside":  # even a link that stays inside the target: restore writes no links
        (target / "elsewhere").mkdir()
        (target / "runs" / "r1").symlink_to(target / "elsewhere")
        expected = "runs/r1 is a symbolic link"
    else:
        (target / "runs" / "r1").symlink_to(outside)
        expected = "runs/r1 is a symbolic link"
    assert_refused(home, root, made, target, expected, force=True)
    assert everything(outside) == {"victim.md": SECRET}


def test_a_backup_made_before_links_were_skipped_still_verifies_and_restores(plain, tmp_path):
    home, root, made = plain
    manifest_path = Path(made["path"]) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["skipped"]  # what every older backup's manifest looks like
    manifest_path.write_text(json.dumps(manifest))
    assert run_ops(home, "backup", "verify", "--to", str(root), env=COMPOSE_ENV).returncode == 0
    target = tmp_path / "restored"
    restored = run_ops(home, "backup", "restore", made["id"], "--root", str(root), "--to", str(target),
                       env=COMPOSE_ENV)
    assert restored.returncode == 0, restored.stderr
    assert (target / "runs" / "r1" / "article.md").read_text() == "# An article\n"
