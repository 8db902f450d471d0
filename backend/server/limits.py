"""A cap on request bodies: a larger one is refused with 413 before it is read into memory or parsed."""

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# A client still sending when the answer comes cannot read it (its next write fails first), so the rest of
# a refused body is read and dropped, chunk by chunk, never held; beyond this much the connection is cut.
DRAIN_BYTES = 64 << 20


async def _drain(receive: Receive, budget: int) -> None:
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        budget -= len(message.get("body", b""))


def _too_large(limit: int) -> str:
    return (f"the request body is larger than this server's limit of {limit} bytes; send a shorter prompt "
            "(or raise --max-body-bytes)")


class BodyLimit:
    """ASGI middleware: Content-Length over the limit is answered at once; a body without one (chunked) is
    counted as it arrives and cut off when it passes the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            if int(length) <= DRAIN_BYTES:
                await _drain(receive, int(length))
            body = json.dumps({"error": {"message": _too_large(self.max_bytes), "type": "invalid_request_error",
                                         "param": None, "code": "request_too_large"}}).encode()
            await send({"type": "http.response.start", "status": 413,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    if message.get("more_body", False):
                        await _drain(receive, DRAIN_BYTES)
                    raise HTTPException(413, _too_large(self.max_bytes))  # answered by the app's error handler
            return message

        await self.app(scope, counted, send)
