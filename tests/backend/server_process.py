"""Start `python -m backend serve` as a real process on a free port, for tests and benchmarks, and read what it
serves (its metrics, its error bodies)."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.serving import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]


class ServerProcess:
    def __init__(self, model: str, *extra: str, wait: bool = True, timeout: float = 180, port: int | None = None,
                 log_path: Path | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # log_path (or SERVER_LOG=path, for debugging) keeps the server's output; the child holds its own fd.
        self.log_path = log_path
        with open(log_path or os.environ.get("SERVER_LOG", os.devnull), "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "backend", "serve", "--model", model, "--port", str(self.port),
                 "--log-level", "warning", *extra],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        if wait:
            self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 180) -> None:
        wait_healthy(self.url, timeout, self.proc)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def metric(server, name: str, **labels: str) -> float:
    """The sample of `name` for the served model "tiny" (every sample carries its model) and `labels`."""
    text = httpx.get(f"{server.url}/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in sorted({"model": "tiny", **labels}.items()))  # as exposed: by name
    match = re.search(rf"^{re.escape(name)}{{{re.escape(want)}}} ([0-9.e+-]+)$", text, re.M)
    assert match or name.endswith("_total"), f"no {name}{{{want}}} in /metrics"  # a counter not yet counted is 0
    return float(match.group(1)) if match else 0.0


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def stream_gaps(url: str, model: str, max_tokens: int, started: threading.Event, gaps: list[float],
                stop: threading.Event | None = None) -> None:
    """A chat stream of max_tokens tokens: the time between its chunks goes to gaps, from its first chunk on
    (started is set then); it returns early once stop is set."""
    body = {"model": model, "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "temperature": 0}
    last = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=3600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
            started.set()
            if stop is not None and stop.is_set():
                return
