"""Our real backend served in this process, behind a listener a test can close and open again on the same port
(connections refused meanwhile, the model staying loaded), which records each request's method and path as it
arrives, so router tests can see exactly what reached which upstream and in what order."""

import threading
import time

import httpx
import uvicorn

from backend.config import EngineConfig
from backend.server.app import build_app
from tests.backend.server_process import free_port


def _serve(app, port: int, lifespan: str) -> tuple[uvicorn.Server, threading.Thread]:
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", lifespan=lifespan, interface="asgi3"
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    return server, thread


def _wait_healthy(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"the backend at {url} was not healthy after {timeout} s")


class InProcessBackend:
    """One app, one engine. A private listener owns the app's lifespan (the model loads once and stays); the
    public one, at `url`, is what the router talks to and what `close()` / `open()` take away and give back."""

    def __init__(self, model: str, name: str = "tiny", max_model_len: int = 256):
        self.app = build_app(
            EngineConfig(model=model, block_size=8, max_model_len=max_model_len), served_model_name=name
        )
        self.state = self.app.state.server
        self.calls: list[tuple[str, str]] = []  # (method, path) of each request through the public listener
        self._home = _serve(self.app, free_port(), "on")
        _wait_healthy(f"http://127.0.0.1:{self._home[0].config.port}")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._public: tuple[uvicorn.Server, threading.Thread] | None = None
        self.open()

    async def _recorded(self, scope, receive, send):
        if scope["type"] == "http":
            self.calls.append((scope["method"], scope["path"]))
        await self.app(scope, receive, send)

    def open(self) -> None:
        """Listen at `url` again."""
        self._public = _serve(self._recorded, self.port, "off")
        deadline = time.monotonic() + 30
        while not self._public[0].started:
            assert time.monotonic() < deadline, f"the listener at {self.url} did not start"
            time.sleep(0.02)

    def close(self) -> None:
        """Stop listening at `url`: connections are refused until `open()`."""
        if self._public is not None:
            server, thread = self._public
            server.should_exit = True
            thread.join(timeout=30)
            self._public = None

    def posts(self, path: str = "/v1/chat/completions") -> int:
        return sum(1 for call in self.calls if call == ("POST", path))

    def stop(self) -> None:
        self.close()
        server, thread = self._home
        server.should_exit = True
        thread.join(timeout=30)
