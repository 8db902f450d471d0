"""`python -m mcp_server --http` as a real process on a free port, for the HTTP tests."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.backend.server_process import ROOT
from tests.serving import free_port, wait_healthy


def _scratch_log() -> str:
    fd, name = tempfile.mkstemp(prefix="mcp-http-", suffix=".log")
    os.close(fd)
    return name


class MCPHTTPServer:
    def __init__(self, env: dict, host: str = "127.0.0.1", cwd=ROOT):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(os.environ.get("SERVER_LOG") or _scratch_log())
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "mcp_server", "--http", "--host", host, "--port",
                                          str(self.port)], cwd=cwd, env={**env, "PYTHONPATH": str(ROOT)},
                                         stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.url, 60, self.proc, "the MCP server")
        except TimeoutError:
            self.stop()
            raise

    def log_tail(self, lines: int = 60) -> str:
        """The server's last lines, for a failing test's message."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
