"""`python -m mcp_server --http` as a real process on a free port, for the HTTP tests."""

import os
import subprocess
import sys

from tests.backend.server_process import ROOT
from tests.serving import free_port, wait_healthy


class MCPHTTPServer:
    def __init__(self, env: dict, host: str = "127.0.0.1", cwd=ROOT):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        with open(os.environ.get("SERVER_LOG", os.devnull), "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "mcp_server", "--http", "--host", host, "--port",
                                          str(self.port)], cwd=cwd, env={**env, "PYTHONPATH": str(ROOT)},
                                         stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.url, 60, self.proc, "the MCP server")
        except TimeoutError:
            self.stop()
            raise

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
