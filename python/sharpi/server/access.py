"""One line per request on stderr, as llama-server logs them, and the request's Prometheus metrics:
an ASGI middleware around the whole application (pure ASGI, not BaseHTTPMiddleware, so a client
that goes away is still seen by the handler, which cancels its generation).

The line: method, path, status, client address and the time from the request's arrival to the end
of its response (a stream's last byte); a generation adds what the handler left in request.state
(openai_api puts the Job's timings there): prompt tokens and those reused from the cache, time to
first text, tokens generated and their rate. GET /health is neither logged nor counted (load
balancers ask it every few seconds; llama-server leaves it out too). Runs on the event loop.
"""

from __future__ import annotations

import time
from typing import TextIO

from .prometheus import ServerMetrics


def _generation_summary(timings: dict) -> str:
    return (f" | prompt {timings['prompt_n']} tokens ({timings['cache_n']} cached), first text after "
            f"{timings['ttft_ms']:.1f} ms, {timings['predicted_n']} tokens generated at "
            f"{timings['predicted_per_second']:.1f} tokens/s")


class AccessLog:
    """Logs and counts every HTTP request of `app` (see the module docstring). `routes`: the
    application's paths, the metrics' route label (any other path counts as "unmatched")."""

    def __init__(self, app, metrics: ServerMetrics, routes: set, log: TextIO | None):
        self.app, self.metrics, self.routes, self.log = app, metrics, routes, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = 500  # when the application fails before it answers

        async def send_and_note(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            seconds = time.perf_counter() - t0
            route = scope["path"] if scope["path"] in self.routes else "unmatched"
            self.metrics.observe(route, status, seconds)
            if self.log is not None:
                client = scope.get("client") or ("-", 0)
                timings = (scope.get("state") or {}).get("generation")
                line = (f"sharpi: {scope['method']} {scope['path']} {status} {client[0]} {seconds * 1e3:.1f} ms"
                        + (_generation_summary(timings) if timings else ""))
                self.log.write(line + "\n")
                self.log.flush()
