"""Errors returned to the client in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""


class APIError(Exception):
    """An error returned to the client in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
