"""A full disk and an unwritable data directory: `orchestrator list` (read-only included) and `create` say in one line
what is full or unwritable and exit non-zero, and nothing already stored is lost.

The full disk is real: a 1 MiB tmpfs filled to its last byte, in a mount namespace of its own (full_disk.py), which
needs root or unprivileged user namespaces; where neither is allowed (an unprivileged container) it is skipped, and
the home that cannot be made at all still runs."""

import json
import shutil
import subprocess
import sys

import pytest

from common.settings import Settings
from tests.backend.server_process import ROOT
from tests.orchestrator.conftest import run_cli
from tests.reliability.full_disk import MOUNT_FAILED


def one_line_error(result: dict, *words: str) -> str:
    assert result["rc"] != 0 and result["stdout"] == "", result
    lines = result["stderr"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result["stderr"], result
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def full_disk(tmp_path_factory) -> dict:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1) to make a private mount namespace")
    home = tmp_path_factory.mktemp("full") / "home"
    for flags in ("-m", "-rm"):  # root, then an unprivileged user namespace
        done = subprocess.run([unshare, flags, sys.executable, "-m", "tests.reliability.full_disk", str(home)],
                              capture_output=True, text=True, cwd=ROOT, timeout=300)
        if done.returncode == 0:
            return json.loads(done.stdout)
        assert done.returncode in (1, MOUNT_FAILED), done.stderr  # 1: unshare itself was refused
    pytest.skip(f"cannot mount a tmpfs in a private namespace here: {done.stderr.strip()[-200:]}")


def test_a_full_disk_is_one_line_and_loses_nothing(full_disk):
    created = full_disk["created"]
    assert len(created) == 3 and all(created)
    assert full_disk["free_when_full"] == 0
    full = full_disk["full"]
    for result in (full["list"], full["list_json"], full["create"]):
        one_line_error(result, "is full", "free some space", "jobs.db")
    freed = json.loads(full_disk["freed"]["stdout"])
    assert sorted(r["id"] for r in freed["runs"]) == sorted(created)  # nothing lost, nothing half-made


def test_a_read_only_home_is_one_line(full_disk):
    for result in full_disk["read_only"].values():
        one_line_error(result, "is not writable", "SCRIPTORIUM_HOME")


def test_a_home_that_cannot_be_made_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    settings = Settings(home=blocker / "home")
    for args in (("list",), ("list", "--json"), ("create", "marginalia")):
        result = run_cli(settings, *args)
        one_line_error({"rc": result.returncode, "stdout": result.stdout, "stderr": result.stderr}, str(blocker))
