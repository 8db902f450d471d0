import os
import subprocess
import sys
import time

from common.files import atomic_write_bytes, atomic_write_text
from common.procs import ProcessIdentity, cmdline, pid_alive, start_time


def test_atomic_write_replaces_whole_file_and_leaves_no_temporaries(tmp_path):
    target = tmp_path / "sub" / "state.json"
    atomic_write_text(target, "old")
    atomic_write_text(target, "new")
    assert target.read_text() == "new"
    assert [p.name for p in target.parent.iterdir()] == ["state.json"]


def test_atomic_write_sets_mode_before_writing(tmp_path):
    target = tmp_path / "secret.env"
    atomic_write_bytes(target, b"TOKEN=x\n", mode=0o600)
    assert (target.stat().st_mode & 0o777) == 0o600


def test_atomic_write_failure_keeps_old_file(tmp_path, monkeypatch):
    target = tmp_path / "f.txt"
    atomic_write_text(target, "kept")

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    try:
        atomic_write_text(target, "lost")
    except OSError as e:
        assert e.errno == 28
    else:
        raise AssertionError("the failed write was not reported")
    assert target.read_text() == "kept"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_identity_tells_a_reused_pid_from_the_recorded_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while "time.sleep(30)" not in " ".join(cmdline(proc.pid) or []) and time.monotonic() < deadline:
            time.sleep(0.01)  # until the child has exec'd: before that /proc shows the parent's command
        assert cmdline(proc.pid)[-1] == "import time; time.sleep(30)"
        me = ProcessIdentity.of(proc.pid)
        assert me.alive() and pid_alive(proc.pid)
        # The same pid with another start time is another process: not alive as far as the record goes.
        impostor = ProcessIdentity(proc.pid, me.start_time + 1)
        assert not impostor.alive()
    finally:
        proc.kill()
        proc.wait()
    assert not me.alive() and start_time(proc.pid) is None


def test_zombie_is_not_alive():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
    assert not pid_alive(proc.pid)
    proc.wait()
