"""`ops up/status/health/down` with the process runner: the real backend and MCP server on free ports."""

import json
import os
import signal
import sys
import time

import httpx

from ops.service_records import pid_alive
from tests.backend.server_process import free_port
from tests.backend.tiny_models import build_model
from tests.ops.conftest import http_service, run_ops, write_stack


def test_the_stack_comes_up_in_order_stays_up_and_goes_down(tmp_path):
    model = build_model("llama", tmp_path / "model")
    env = {"SCRIPTORIUM_BACKEND_PORT": str(free_port()), "SCRIPTORIUM_MCP_PORT": str(free_port()),
           "SCRIPTORIUM_MODEL": str(model)}
    up = run_ops(tmp_path, "up", env=env)
    assert up.returncode == 0, up.stderr
    lines = [line.split()[0] + " " + line.split(maxsplit=1)[1] for line in up.stderr.splitlines()]
    assert lines.index("backend healthy") < lines.index("mcp started (process)")  # mcp waits for the backend
    assert "python -m mcp_server install --client claude-code --http" in up.stdout

    status = json.loads(run_ops(tmp_path, "status", "--json", env=env).stdout)
    services = {s["service"]: s for s in status["services"]}
    assert services["backend"]["state"] == services["mcp"]["state"] == "healthy"
    assert services["comfyui"]["state"] == "stopped"  # profile image was not asked for
    assert httpx.get(f"http://127.0.0.1:{env['SCRIPTORIUM_MCP_PORT']}/health").status_code == 200
    pids = {name: services[name]["pid"] for name in ("backend", "mcp")}
    assert (tmp_path / "logs" / "backend.log").exists() and (tmp_path / "state" / "backend.json").exists()

    again = run_ops(tmp_path, "up", env=env)
    assert again.returncode == 0 and again.stderr.count("already healthy") == 2
    status = json.loads(run_ops(tmp_path, "status", "--json", env=env).stdout)
    assert {s["service"]: s["pid"] for s in status["services"] if s["pid"]} == pids  # nothing restarted

    health = run_ops(tmp_path, "health", "--json", env=env)
    report = json.loads(health.stdout)
    assert health.returncode == 0 and report["ok"] and report["disk"]["free"] > 0
    os.kill(pids["mcp"], signal.SIGKILL)
    time.sleep(0.5)
    health = run_ops(tmp_path, "health", env=env)
    assert health.returncode == 1 and "mcp is dead" in health.stderr

    logs = run_ops(tmp_path, "logs", "backend", env=env)
    assert logs.returncode == 0 and "GET /health" in logs.stdout.splitlines()[-1]  # the last lines, by default
    logs = run_ops(tmp_path, "logs", "backend", "--lines", "100000", env=env)  # its start: past many health checks
    assert logs.returncode == 0 and "ops started backend" in logs.stdout

    down = run_ops(tmp_path, "down", env=env)
    assert down.returncode == 0 and "stopped" in down.stdout
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in pids.values())
    assert list((tmp_path / "state").glob("*.json")) == []
    assert run_ops(tmp_path, "health", env=env).returncode == 1  # nothing running is not healthy


def compose_with(tmp_path, second: str) -> dict:
    return write_stack(tmp_path, http_service("first", free_port(), 5) + f"""  second:
    image: unused
    depends_on: [first]
    x-ops:
      health: http://127.0.0.1:{free_port()}/health
      native: {second}
      health_timeout: 3
      stop_timeout: 2
""")


def test_a_service_that_never_gets_healthy_is_reported_and_the_rest_stopped(tmp_path):
    env = compose_with(tmp_path, json.dumps([sys.executable, "-c", "print('warming up the quills', flush=True); "
                                                                   "import time; time.sleep(120)"]))
    up = run_ops(tmp_path / "home", "up", env=env)
    assert up.returncode == 1
    assert "second was not healthy after 3 s" in up.stderr and "warming up the quills" in up.stderr
    status = json.loads(run_ops(tmp_path / "home", "status", "--json", env=env).stdout)
    assert all(s["state"] == "stopped" for s in status["services"])  # what this call started was stopped again

    kept = run_ops(tmp_path / "home", "up", "--keep", env=env)
    assert kept.returncode == 1
    status = json.loads(run_ops(tmp_path / "home", "status", "--json", env=env).stdout)
    states = {s["service"]: s["state"] for s in status["services"]}
    assert states == {"first": "healthy", "second": "unhealthy"}
    run_ops(tmp_path / "home", "down", env=env)


def test_a_service_that_exits_at_once_shows_its_log(tmp_path):
    env = compose_with(tmp_path, json.dumps([sys.executable, "-c", "print('ink spilled'); raise SystemExit(3)"]))
    up = run_ops(tmp_path / "home", "up", env=env)
    assert up.returncode == 1
    assert "second exited before it became healthy" in up.stderr and "ink spilled" in up.stderr
