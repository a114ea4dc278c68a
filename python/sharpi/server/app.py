"""The Starlette application of `sharpi serve`: which path goes to which handler, the middleware
around them, and the error handlers that keep every failure in OpenAI's error shape (Anthropic's on
/v1/messages, errors.error_body), with 400 for a
bad request (malformed JSON, bad sampling values, a prompt longer than the context), 401 without a
valid key (--api-key), 404 for an unknown model or path, 405 for a wrong method and 413 for a body
over --max-body.

Endpoints: POST /v1/chat/completions and /v1/completions (openai_api), POST /v1/messages and
/v1/messages/count_tokens (anthropic_api), GET /v1/models, GET /health,
GET /v1/sharpi/stats (request counts and the live expert-cache view, live.py), GET / (web/index.html:
a chat box beside small plots of that view), POST /tokenize, POST /detokenize and GET /props
(llama_api), GET /metrics (prometheus), GET /openapi.json (openapi).

Middleware, outermost first: the access log and request metrics (access.py), CORS for the origins
given with --cors-origin (Starlette's CORSMiddleware: preflights answered, other origins refused),
the API key check (auth.py).
"""

from __future__ import annotations

import os
import time
from typing import TextIO

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from . import anthropic_api, llama_api, openai_api
from .access import AccessLog
from .auth import ApiKeyAuth
from .body import read_json
from .errors import ApiError, error_body
from .openapi import openapi_document
from .prometheus import ServerMetrics
from .served import ServedModel

WEB_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "web")


def create_app(served: ServedModel, log: TextIO | None = None, api_keys: list | None = None,
               cors_origins: list | None = None) -> Starlette:
    """The Starlette application serving `served`; one line per request goes to `log` (None: no
    log); `api_keys`: the keys a request must carry one of (None or empty: no check);
    `cors_origins`: the browser origins allowed to call the API ("*": any)."""
    created = int(time.time())
    with open(os.path.join(WEB_DIR, "index.html"), encoding="utf-8") as f:
        page_html = f.read()
    metrics = ServerMetrics(served.engine)
    document = openapi_document(api_key=bool(api_keys))
    error_response = openai_api.error_response

    async def chat_completions(request: Request):
        return await openai_api.complete(request, served, chat=True)

    async def completions(request: Request):
        return await openai_api.complete(request, served, chat=False)

    async def messages(request: Request):
        return await anthropic_api.messages(request, served)

    async def count_tokens(request: Request):
        return await anthropic_api.count_tokens(request, served)

    async def models(request: Request):
        return JSONResponse(openai_api.models(served, created))

    async def stats(request: Request):
        return JSONResponse({**served.engine.snapshot(), "live": served.engine.live.view()})

    async def tokenize(request: Request):
        try:
            body = await read_json(request, served.max_body)
            return Response(await llama_api.tokenize(served, body), media_type="application/json")
        except ApiError as e:
            return error_response(e)

    async def detokenize(request: Request):
        try:
            return JSONResponse(await llama_api.detokenize(served, await read_json(request, served.max_body)))
        except ApiError as e:
            return error_response(e)

    async def props(request: Request):
        return JSONResponse(llama_api.props(served))

    async def prometheus_metrics(request: Request):
        return Response(metrics.text(), media_type=metrics.content_type)

    async def openapi(request: Request):
        return JSONResponse(document)

    async def page(request: Request):
        return HTMLResponse(page_html)

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    def path_error_response(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(error_body(e, request.url.path), status_code=e.status)

    async def http_error(request: Request, exc: HTTPException):
        return path_error_response(request, ApiError(exc.status_code, f"{request.method} {request.url.path}: "
                                                     f"{exc.detail}"))

    async def server_error(request: Request, exc: Exception):
        # A bug, not a bad request: still the protocol's error shape, so clients show the message.
        return path_error_response(request, ApiError(500, f"{type(exc).__name__}: {exc}"))

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/sharpi/stats", stats, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/props", props, methods=["GET"]),
        Route("/metrics", prometheus_metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/", page, methods=["GET"]),
    ]
    middleware = [
        Middleware(AccessLog, metrics=metrics, routes={r.path for r in routes}, log=log),
        Middleware(CORSMiddleware, allow_origins=list(cors_origins or []), allow_methods=["GET", "POST"],
                   allow_headers=["*"], max_age=600),
    ]
    if api_keys:
        middleware.append(Middleware(ApiKeyAuth, keys=list(api_keys)))
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={HTTPException: http_error, Exception: server_error})
