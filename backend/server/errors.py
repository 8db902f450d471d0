"""Errors returned to the client in OpenAI's shape ({"error": {"message", "type", "param", "code"}}) or, on the
Messages API, Anthropic's."""


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
