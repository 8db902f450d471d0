"""ops under faults: pids that were reused, state and lease files that are damaged, crashes midway. Real
processes, real files, the real `ops` command."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.procs import pid_alive, start_time
from ops import lease_repair
from ops.service_records import Record, State
from tests.backend.server_process import free_port
from tests.ops.conftest import http_service, run_ops, write_stack
from tests.reliability.disk_log import DiskLog


@pytest.fixture
def bystander():
    """A process that has nothing to do with ops but holds a pid ops once recorded (the pid was reused).
    It leads its own process group, as daemons do, so a signal to the recorded group would reach it."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def one_service_stack(tmp_path) -> dict:
    port = free_port()
    return {**write_stack(tmp_path, http_service("first", port, 3)), "HEALTH": f"http://127.0.0.1:{port}/"}


def write_record(home: Path, env: dict, **fields) -> None:
    """A state file as an ops of this version (with start_time) or an older one (without) wrote it."""
    (home / "state").mkdir(parents=True, exist_ok=True)
    (home / "state" / "first.json").write_text(json.dumps({"service": "first", "runner": "process",
                                                           "health": env["HEALTH"], "started": time.time() - 3600,
                                                           **fields}))


def test_down_does_not_kill_the_process_that_now_has_a_recorded_pid(tmp_path, bystander):
    env = one_service_stack(tmp_path)
    home = tmp_path / "home"
    # Same pid, same command even, but another start time: another process.
    write_record(home, env, pid=bystander.pid, command=[sys.executable, "-c", "import time; time.sleep(120)"],
                 start_time=start_time(bystander.pid) - 1)
    status = json.loads(run_ops(home, "status", "--json", env=env).stdout)
    assert {s["service"]: s["state"] for s in status["services"]} == {"first": "dead"}
    down = run_ops(home, "down", env=env)
    assert down.returncode == 0, down.stderr
    time.sleep(0.3)
    assert bystander.poll() is None and pid_alive(bystander.pid)
    assert not (home / "state" / "first.json").exists()  # the stale record is forgotten


def test_an_old_record_without_start_time_is_gone_unless_its_command_matches(tmp_path, bystander):
    env = one_service_stack(tmp_path)
    home = tmp_path / "home"
    write_record(home, env, pid=bystander.pid, command=["/usr/bin/scriptorium-backend", "--port", "8000"])
    assert json.loads(run_ops(home, "status", "--json", env=env).stdout)["services"][0]["state"] == "dead"
    assert run_ops(home, "down", env=env).returncode == 0
    time.sleep(0.3)
    assert bystander.poll() is None
    # A record from before start times that does name what runs there is still ours to stop.
    write_record(home, env, pid=bystander.pid, command=[sys.executable, "-c", "import time; time.sleep(120)"])
    assert run_ops(home, "down", env=env).returncode == 0
    assert bystander.wait(timeout=10) == -signal.SIGTERM


def test_up_over_a_stale_record_starts_the_service_and_spares_the_pid_holder(tmp_path, bystander):
    env = one_service_stack(tmp_path)
    home = tmp_path / "home"
    write_record(home, env, pid=bystander.pid, command=["/opt/old/server"])  # as an older ops wrote it
    up = run_ops(home, "up", env=env)
    try:
        assert up.returncode == 0, up.stderr
        time.sleep(0.3)
        assert bystander.poll() is None
        record = State(home).get("first")
        assert record.pid != bystander.pid and record.start_time == start_time(record.pid)
    finally:
        run_ops(home, "down", env=env)
    assert bystander.poll() is None and not pid_alive(record.pid)


def test_a_damaged_state_file_or_the_lease_beside_it_breaks_no_command(tmp_path):
    env = one_service_stack(tmp_path)
    home = tmp_path / "home"
    (home / "state").mkdir(parents=True)
    (home / "state" / "first.json").write_text('{"service": "first", "runn')  # torn by an old non-atomic write
    (home / "state" / "lease.json").write_text(json.dumps({"asleep": True, "since": time.time(),
                                                           "expires": time.time() + 600,
                                                           "holders": {str(os.getpid()): 1},
                                                           "starts": {str(os.getpid()): start_time(os.getpid())},
                                                           "last_job_end": None}))
    status = run_ops(home, "status", "--json", env=env)
    assert status.returncode == 0 and "Traceback" not in status.stderr
    assert json.loads(status.stdout)["services"][0]["state"] == "stopped"
    assert "first.json" in status.stderr  # named, not silently dropped
    health = run_ops(home, "health", "--json", env=env)
    assert "Traceback" not in health.stderr and json.loads(health.stdout)["ok"] is False


def test_a_lease_held_by_a_reused_pid_is_repaired_and_a_live_holder_kept(tmp_path, bystander):
    home = tmp_path / "home"
    file = lease_repair.LeaseFile(home)
    file.dir.mkdir(parents=True)
    lent = {"asleep": True, "since": time.time(), "expires": time.time() + 3600, "last_job_end": None,
            "backend": None, "comfyui": None}
    file.write({**lent, "holders": {str(os.getpid()): 1}, "starts": {str(os.getpid()): start_time(os.getpid())}})
    assert lease_repair.repair(home, None) == [] and file.read()["asleep"]  # its holder runs: the lease stands
    # The image job that took the lease died; its pid now belongs to the bystander.
    file.write({**lent, "holders": {str(bystander.pid): 1},
                "starts": {str(bystander.pid): start_time(bystander.pid) - 5}})
    repaired = lease_repair.repair(home, None)
    assert repaired and "gone" in repaired[0]
    assert file.read() is None and bystander.poll() is None


def test_state_records_and_the_lease_are_written_atomically_and_fsynced(tmp_path, monkeypatch):
    disk = DiskLog(monkeypatch)
    home = tmp_path / "home"
    State(home).put(Record(service="first", runner="process", pid=os.getpid()))
    assert disk.synced_before_rename(home / "state" / "first.json")
    file = lease_repair.LeaseFile(home)
    file.write({"asleep": True})
    assert disk.synced_before_rename(file.path)
    assert sorted(p.name for p in (home / "state").iterdir()) == ["first.json", "lease.json"]  # no temporaries
