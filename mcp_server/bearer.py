"""The HTTP transport's bearer token (RFC 6750): one shared secret, SCRIPTORIUM_MCP_TOKEN.

There is no OAuth authorization server, so no RFC 9728 metadata is served and the challenge names none:
a request without credentials gets `WWW-Authenticate: Bearer realm="..."` and no error code (RFC 6750
section 3.1), a wrong token the same with error="invalid_token"."""

import hmac
import json

REALM = "scriptorium"
OPEN_PATHS = ("/health",)  # health checks (ops, compose) carry no token
HINT = "send Authorization: Bearer <token>, the token the server has in SCRIPTORIUM_MCP_TOKEN"


class BearerToken:
    """ASGI middleware: every HTTP request but the health check must carry the token."""

    def __init__(self, app, token: str):
        self.app = app
        self._expected = token.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = _bearer(scope)
        if given is None:
            return await _refuse(send, f'Bearer realm="{REALM}"', {"error": "unauthorized", "message": HINT})
        if not hmac.compare_digest(given.encode(), self._expected):
            challenge = f'Bearer realm="{REALM}", error="invalid_token", error_description="the token is not valid"'
            return await _refuse(send, challenge, {"error": "invalid_token", "message": f"wrong token: {HINT}"})
        return await self.app(scope, receive, send)


def _bearer(scope) -> str | None:
    """The bearer token in the Authorization header (any case of the scheme), or None when there is none."""
    for name, value in scope["headers"]:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
    return None


async def _refuse(send, challenge: str, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"www-authenticate", challenge.encode()), (b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
