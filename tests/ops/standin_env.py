"""Put the vLLM and SGLang stand-ins (tests/ops/engine_standins.py) where ops' process runner finds the real ones:
a `vllm` program on PATH, and a `sglang.launch_server` module for `python -m`."""

import os
import subprocess
import sys
from pathlib import Path

import httpx

from tests.backend.server_process import ROOT
from tests.serving import free_port, wait_healthy


def standin_env(root: Path) -> dict[str, str]:
    bin_dir, packages = root / "bin", root / "site"
    (packages / "sglang").mkdir(parents=True, exist_ok=True)
    bin_dir.mkdir(parents=True, exist_ok=True)
    vllm = bin_dir / "vllm"
    vllm.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m tests.ops.engine_standins vllm "$@"\n')
    vllm.chmod(0o755)
    (packages / "sglang" / "__init__.py").write_text("")
    (packages / "sglang" / "launch_server.py").write_text(
        "import sys\n\nfrom tests.ops.engine_standins import sglang_main\n\nsglang_main(sys.argv[1:])\n")
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(packages)])}


class StandinServer:
    """A stand-in engine as a real process on a free port: kind vllm or sglang, with its own command line."""

    def __init__(self, kind: str, *args: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = ["serve", "tiny", "--host", "127.0.0.1", "--port", str(self.port)] if kind == "vllm" else \
            ["--model-path", "tiny", "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.ops.engine_standins", kind, *argv, *args], cwd=ROOT,
                                     env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        try:
            wait_healthy(self.url, 30, self.proc, f"the {kind} stand-in")
        except TimeoutError:
            self.stop()
            raise

    def state(self) -> dict:
        return httpx.get(f"{self.url}/_test/state", timeout=2).json()

    def calls(self, path: str) -> list[dict]:
        return [c for c in self.state()["calls"] if c["path"] == path]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
