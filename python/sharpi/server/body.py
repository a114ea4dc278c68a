"""Reading a request's JSON body without stalling the event loop: at most `max_body` bytes
(--max-body; more is a 413 in OpenAI's error shape, refused from Content-Length before any of the
body is read, else as soon as the streamed body passes the limit, so a huge body is never held in
memory), parsed in a worker thread (json.loads of megabytes takes tens of milliseconds, the
event loop answers /health meanwhile). Runs on the event loop.
"""

from __future__ import annotations

import json

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request

from .errors import ApiError

DEFAULT_MAX_BODY = 8 * 1024 * 1024


def _too_large(size: str, max_body: int) -> ApiError:
    return ApiError(413, f"the request body is {size}; this server takes at most {max_body} bytes (--max-body)",
                    code="request_too_large")


async def read_limited(request: Request, max_body: int) -> bytes:
    """The request body, or ApiError 413 once it is longer than max_body bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body:
        raise _too_large(f"{int(declared)} bytes", max_body)
    chunks, n = [], 0
    try:
        async for chunk in request.stream():
            n += len(chunk)
            if n > max_body:
                raise _too_large(f"more than {max_body} bytes", max_body)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(400, "the client went away before sending its request") from None
    return b"".join(chunks)


def _parse(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


async def read_json(request: Request, max_body: int) -> dict:
    """The request body as a JSON object (ApiError 400 when it is not one, 413 when too long)."""
    return await run_in_threadpool(_parse, await read_limited(request, max_body))


def require_unicode(text: str, param: str) -> None:
    """ApiError 400 when `text` is not Unicode text: JSON may escape half of a surrogate pair
    ("\\ud800") that no tokenizer can take. A copy of the text (about a millisecond a megabyte)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"'{param}' is not valid Unicode: {e.reason} at character {e.start}", param=param) from None
