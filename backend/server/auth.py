"""--api-key: every request must carry the key, as OpenAI's clients send it (Authorization: Bearer) or as
Anthropic's do (x-api-key), the admin routes (/sleep, /wake_up, /is_sleeping, /tokenize, ...) as much as /v1.
Only OPEN_PATHS answer without it. The check is on the exact path the router matches (the server has decoded
it), so a route reached by another spelling (/sleep/, //sleep, /SLEEP, /%73leep) is refused as well, before
anything else reads the request."""

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from backend.server.errors import APIError, error_body

# Probes and scrapers that hold no key: what they answer changes nothing and shows no prompt or answer.
# /health: Docker's healthcheck and ops; /metrics: Prometheus; /: what Claude Code probes before its first request.
OPEN_PATHS = frozenset({"/", "/health", "/metrics"})


def presented_key(headers: dict[bytes, bytes]) -> str | None:
    auth = headers.get(b"authorization", b"").decode("latin-1")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    key = headers.get(b"x-api-key")
    return key.decode("latin-1").strip() if key is not None else None


class APIKey:
    """ASGI middleware: a request without the server's key is answered 401 in its API's error shape, unless its
    path is one of OPEN_PATHS."""

    def __init__(self, app: ASGIApp, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = presented_key(dict(scope["headers"]))
        if given is not None and hmac.compare_digest(given.encode("latin-1"), self.key):  # the bytes sent
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # before accept: the client sees a 403
            return
        message = ("this server needs an API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
                   if given is None else "the API key is not this server's (see its --api-key)")
        error = APIError(401, message, type="authentication_error", code="invalid_api_key")
        body = json.dumps(error_body(scope["path"], error)).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b'Bearer realm="scriptorium"')]})
        await send({"type": "http.response.body", "body": body})
