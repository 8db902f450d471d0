import json
import os
import subprocess
import sys

import pytest

from tests.backend.server_process import ROOT


def run_ops(home, *args, env=None, timeout=600):
    full = {**os.environ, "SCRIPTORIUM_HOME": str(home), **(env or {})}
    return subprocess.run([sys.executable, "-m", "ops", *args], capture_output=True, text=True, env=full,
                          timeout=timeout, cwd=ROOT)


def http_service(name: str, port: int, stop_timeout: int) -> str:
    """A compose.yaml service that ops runs natively: python's http.server on port, healthy once it answers."""
    return f"""  {name}:
    image: unused
    x-ops:
      health: http://127.0.0.1:{port}/
      native: ["{sys.executable}", "-m", "http.server", "--bind", "127.0.0.1", "{port}"]
      stop_timeout: {stop_timeout}
"""


def write_stack(tmp_path, services: str) -> dict:
    """A compose.yaml of these services in tmp_path; the environment that points ops at it."""
    (tmp_path / "compose.yaml").write_text("services:\n" + services)
    return {"SCRIPTORIUM_COMPOSE": str(tmp_path / "compose.yaml")}


@pytest.fixture
def gpu_file(tmp_path):
    """Write a simulated device for the probe (SCRIPTORIUM_GPU_PROBE_FILE, its only seam)."""

    def make(total_gib: float, free_gib: float, processes=()) -> dict:
        path = tmp_path / "gpu.json"
        path.write_text(json.dumps([{
            "index": 0, "name": "NVIDIA GeForce RTX 4090", "total": int(total_gib * 2**30),
            "free": int(free_gib * 2**30),
            "processes": [{"pid": pid, "name": name, "used": int(gib * 2**30)} for pid, name, gib in processes],
        }]))
        return {"SCRIPTORIUM_GPU_PROBE_FILE": str(path)}

    return make
