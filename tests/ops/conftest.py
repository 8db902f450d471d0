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
