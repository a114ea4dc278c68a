"""ApiError: a request the server refuses, answered with its HTTP status in OpenAI's error shape,
{"error": {"message", "type", "param", "code"}}, or on Anthropic's paths in Anthropic's,
{"type": "error", "error": {"type", "message"}}."""

from __future__ import annotations


class ApiError(Exception):
    """A request the server refuses, answered in OpenAI's error shape with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        """The error in Anthropic's shape, its type named by the status as Anthropic's API names it."""
        kind = ANTHROPIC_ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


# Anthropic's error type of each HTTP status (docs.anthropic.com, "Errors"); 503 is this server's
# "overloaded" as 529 is Anthropic's.
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                         429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}

# Where Anthropic's protocol is served (anthropic_api): errors there, from any layer (the API key
# check, an unknown method, a failure), are in Anthropic's shape.
ANTHROPIC_PATH_PREFIX = "/v1/messages"


def error_body(error: ApiError, path: str) -> dict:
    """The error's body in the shape of the protocol served at `path`."""
    return error.anthropic_body() if path.startswith(ANTHROPIC_PATH_PREFIX) else error.body()
