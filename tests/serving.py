"""Servers the tests start: an ASGI app on a real uvicorn listener in this process, and the one wait for any of
our servers (in this process or a child) to answer its health check, and the one wait for any other condition."""

import socket
import subprocess
import threading
import time

import httpx
import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(
    url: str, timeout: float, proc: subprocess.Popen | None = None, what: str = "the server"
) -> None:
    """Until GET {url}/health answers 200; raises when proc (the server's process, if a child) exits first or the
    time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{what} at {url} was not healthy after {timeout} s")


def wait_for(predicate, timeout: float = 120, interval: float = 0.1):
    """predicate()'s first true value, looking every interval; TimeoutError (with its last value) after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            break
        time.sleep(interval)
    if not value:
        raise TimeoutError(f"condition not met in {timeout} s (last: {value!r})")
    return value


def serve_in_thread(app, port: int | None = None, **config) -> tuple[uvicorn.Server, threading.Thread, str]:
    """The app on 127.0.0.1 (a free port unless given) in a daemon thread: (server, thread, url). Stop it with
    server.should_exit = True."""
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port or free_port(), log_level="warning", **config)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    return server, thread, f"http://127.0.0.1:{server.config.port}"
