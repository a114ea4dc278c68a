"""ApiError: a request the server refuses, answered in OpenAI's error shape,
{"error": {"message", "type", "param", "code"}}, with its HTTP status."""

from __future__ import annotations


class ApiError(Exception):
    """A request the server refuses, answered in OpenAI's error shape with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
