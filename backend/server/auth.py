"""--api-key: every /v1 request must carry the key, as OpenAI's clients send it (Authorization: Bearer) or as
Anthropic's do (x-api-key); /health, /metrics and the rest stay open for probes, as vLLM's do."""

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from backend.server.errors import APIError


def presented_key(headers: dict[bytes, bytes]) -> str | None:
    auth = headers.get(b"authorization", b"").decode("latin-1")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    key = headers.get(b"x-api-key")
    return key.decode("latin-1").strip() if key is not None else None


class APIKey:
    """ASGI middleware: a /v1 request without the server's key is answered 401 in its API's error shape."""

    def __init__(self, app: ASGIApp, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        given = presented_key(dict(scope["headers"]))
        if given is not None and hmac.compare_digest(given.encode(), self.key):
            await self.app(scope, receive, send)
            return
        message = ("this server needs an API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
                   if given is None else "the API key is not this server's (see its --api-key)")
        error = APIError(401, message, type="authentication_error", code="invalid_api_key")
        anthropic = scope["path"].startswith("/v1/messages")
        body = json.dumps(error.anthropic_body() if anthropic else error.body()).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b'Bearer realm="scriptorium"')]})
        await send({"type": "http.response.body", "body": body})
