"""Health alerts reach a command and a webhook; the monitor reports the simulated GPU."""

import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

from tests.backend.server_process import free_port
from tests.ops.conftest import http_service, run_ops, write_stack


def stack_with_a_dead_service(tmp_path) -> dict:
    env = write_stack(tmp_path, http_service("web", free_port(), 3))
    assert run_ops(tmp_path / "home", "up", env=env).returncode == 0
    status = json.loads(run_ops(tmp_path / "home", "status", "--json", env=env).stdout)
    os.kill(status["services"][0]["pid"], signal.SIGKILL)
    time.sleep(0.3)
    return env


def test_the_alert_command_receives_the_failure_json(tmp_path):
    env = stack_with_a_dead_service(tmp_path)
    out = tmp_path / "alert.json"
    first = run_ops(tmp_path / "home", "health", "--alert", f"cat > {out}", env=env)
    assert first.returncode == 1
    sent = json.loads(out.read_text())
    assert sent["failed"][0]["service"] == "web" and sent["failed"][0]["state"] == "dead"
    since = sent["failed"][0]["since"]
    time.sleep(1.1)
    run_ops(tmp_path / "home", "health", "--alert", f"cat > {out}", env=env)
    assert json.loads(out.read_text())["failed"][0]["since"] == since  # since when, not since this check
    run_ops(tmp_path / "home", "down", env=env)


def test_the_webhook_receives_the_failure_json(tmp_path):
    env = stack_with_a_dead_service(tmp_path)
    received = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 the http.server interface
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Hook)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        result = run_ops(tmp_path / "home", "health", "--webhook",
                         f"http://127.0.0.1:{server.server_port}/alert", env=env)
        assert result.returncode == 1 and received and received[0]["failed"][0]["service"] == "web"
        assert "web is dead" in received[0]["problems"][0]
        # The systemd units pass the URL through their private environment file, not the command line.
        hook_env = {**env, "SCRIPTORIUM_ALERT_WEBHOOK": f"http://127.0.0.1:{server.server_port}/alert"}
        assert run_ops(tmp_path / "home", "health", env=hook_env).returncode == 1 and len(received) == 2
    finally:
        server.shutdown()
        run_ops(tmp_path / "home", "down", env=env)


def test_monitor_once_json_with_the_simulated_gpu(tmp_path, gpu_file):
    env = gpu_file(24, 10, processes=[(321, "comfyui", 9.5)])
    result = run_ops(tmp_path, "monitor", "--once", "--json", env=env)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    device = data["gpu"]["devices"][0]
    assert data["gpu"]["source"] == "file" and device["used"] == 14 * 2**30
    assert device["processes"][0]["name"] == "comfyui"
    assert {s["service"] for s in data["services"]} == {"backend", "mcp", "comfyui"}
