"""The Starlette application of `sharpi serve`: which path goes to which handler, and the error
handlers that keep every failure in OpenAI's error shape, with 400 for a bad request (malformed
JSON, bad sampling values, a prompt longer than the context) and 404 for an unknown model or path.

Endpoints: POST /v1/chat/completions and /v1/completions (openai_api), GET /v1/models, GET /health,
GET /v1/sharpi/stats (request counts and the live expert-cache view, live.py), GET / (web/index.html:
a chat box beside small plots of that view).
"""

from __future__ import annotations

import os
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse
from starlette.routing import Route

from . import openai_api
from .errors import ApiError
from .served import ServedModel

WEB_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "web")


def create_app(served: ServedModel) -> Starlette:
    """The Starlette application serving `served`."""
    created = int(time.time())
    with open(os.path.join(WEB_DIR, "index.html"), encoding="utf-8") as f:
        page_html = f.read()

    async def chat_completions(request: Request):
        return await openai_api.complete(request, served, chat=True)

    async def completions(request: Request):
        return await openai_api.complete(request, served, chat=False)

    async def models(request: Request):
        return JSONResponse(openai_api.models(served, created))

    async def stats(request: Request):
        counts, busy = served.engine.snapshot()
        return JSONResponse({**counts, "busy": busy, "live": served.engine.live.view()})

    async def page(request: Request):
        return HTMLResponse(page_html)

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    async def http_error(request: Request, exc: HTTPException):
        return openai_api.error_response(
            ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    async def server_error(request: Request, exc: Exception):
        # A bug, not a bad request: still OpenAI's shape, so clients show the message.
        return openai_api.error_response(ApiError(500, f"{type(exc).__name__}: {exc}"))

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/v1/sharpi/stats", stats, methods=["GET"]),
            Route("/", page, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: server_error},
    )
