"""Errors returned to the client in OpenAI's shape ({"error": {"message", "type", "param", "code"}}) or, on the
Messages API, Anthropic's."""

import json
import logging

log = logging.getLogger("backend.server")


class APIError(Exception):
    """An error returned to the client in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        """The same error in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
        kind = ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


# Anthropic's error types by status; 503 (loading, asleep: retry after Retry-After) reads as overloaded, which
# its SDKs and Claude Code retry.
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                   503: "overloaded_error", 529: "overloaded_error"}


def error_body(path: str, error: APIError) -> dict:
    """The error in the shape of the API asked: Anthropic's on the Messages API, OpenAI's elsewhere."""
    return error.anthropic_body() if path.startswith("/v1/messages") else error.body()


class InternalErrors:
    """ASGI middleware: an unexpected exception is answered here as the API's 500. Starlette's handler for
    Exception answers too, but then re-raises to the server, which closes the connection: a client's next request
    on that kept-alive connection failed with a reset. A stream already begun is left to end as it does."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as e:
            if started:
                raise
            log.exception("internal error")
            body = json.dumps(error_body(scope["path"], APIError(500, f"internal error: {e}",
                                                                  type="internal_error"))).encode()
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
