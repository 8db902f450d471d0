"""The server's end on SIGTERM: uvicorn stops taking connections and waits up to --shutdown-timeout for those in
flight, then cancels their tasks (a traceback each in the log, a stream cut without its last event). A second
before that, the engines end whatever still runs themselves: each request gets a 503 saying the server is
shutting down (a stream as its last event), and uvicorn finds nothing left to cancel. Every kind of request
(streams, embeddings) is engine work ended between two steps, so this takes a step, not the request's time."""

import asyncio
import socket

import uvicorn

from backend.server.registry import ModelRegistry


async def end_requests(registry: ModelRegistry, timeout: float) -> None:
    """Let the requests in flight finish for up to timeout seconds, then end the rest with a 503."""
    await asyncio.gather(*(s.engine.drain(timeout, "the server is shutting down") for s in registry.loaded()))


class EndingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, registry: ModelRegistry):
        super().__init__(config)
        self.registry = registry

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timeout = self.config.timeout_graceful_shutdown
        ending = None if timeout is None else asyncio.ensure_future(end_requests(self.registry, max(timeout - 1, 0)))
        try:
            await super().shutdown(sockets)
        finally:
            if ending is not None:
                ending.cancel()
