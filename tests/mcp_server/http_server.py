"""`python -m mcp_server --http` as a real process on a free port, for the HTTP tests."""

import os
import subprocess
import sys
import time

import httpx

from tests.backend.server_process import ROOT, free_port


class MCPHTTPServer:
    def __init__(self, env: dict, host: str = "127.0.0.1", cwd=ROOT):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        with open(os.environ.get("SERVER_LOG", os.devnull), "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "mcp_server", "--http", "--host", host, "--port",
                                          str(self.port)], cwd=cwd, env={**env, "PYTHONPATH": str(ROOT)},
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the MCP server exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        self.stop()
        raise TimeoutError("the MCP server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
