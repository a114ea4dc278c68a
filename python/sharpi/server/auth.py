"""--api-key: every request but GET /health, the page at / and /openapi.json must carry one of the
server's keys, as `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's);
any other gets 401 in OpenAI's error shape (Anthropic's on /v1/messages). A CORS preflight (OPTIONS) passes: browsers send it
without credentials, and the CORS middleware outside this one answers it. Keys are compared in
constant time. Runs on the event loop.
"""

from __future__ import annotations

import hmac
import json

from .errors import ApiError, error_body

# Paths anyone may GET: liveness, the page (whose requests then need the key), the API's description.
OPEN_PATHS = frozenset({"/health", "/", "/openapi.json"})


class ApiKeyAuth:
    def __init__(self, app, keys: list):
        self.app = app
        self.keys = [k.encode("utf-8") for k in keys]

    def _authorized(self, headers: dict) -> bool:
        auth = headers.get(b"authorization", b"")
        given = auth[7:].strip() if auth[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        # Every key is compared, so the time taken says nothing about which one nearly matched.
        return bool(given) and sum(hmac.compare_digest(given, k) for k in self.keys) > 0

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in OPEN_PATHS
                or self._authorized(dict(scope["headers"]))):
            return await self.app(scope, receive, send)
        error = ApiError(401, "a valid API key is required: send 'Authorization: Bearer KEY' or 'x-api-key: KEY' "
                         "(sharpi serve --api-key)", code="invalid_api_key")
        body = json.dumps(error_body(error, scope["path"])).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
