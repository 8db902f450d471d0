"""Our real backend served in this process, behind a listener a test can close and open again on the same port
(connections refused meanwhile, the model staying loaded), which records each request's method and path as it
arrives, so router tests can see exactly what reached which upstream and in what order."""

import threading
import time

import uvicorn

from backend.config import EngineConfig
from backend.server.app import build_app
from tests.serving import free_port, serve_in_thread, wait_healthy


def _serve(app, port: int, lifespan: str) -> tuple[uvicorn.Server, threading.Thread]:
    server, thread, _ = serve_in_thread(app, port, lifespan=lifespan, interface="asgi3")
    return server, thread


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
        wait_healthy(f"http://127.0.0.1:{self._home[0].config.port}", 120, what="the backend")
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
