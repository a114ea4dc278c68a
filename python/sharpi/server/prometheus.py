"""GET /metrics: Prometheus text (prometheus_client), one registry per application.

Two kinds of metric: HTTP requests (counted by access.py as each response ends: by route and
status, and a latency histogram by route), and the engine's own counts (Engine.snapshot(), read
at scrape time by a collector, so they are never copied or double-counted: finished generations,
cancelled ones, prompt tokens prefilled and reused from the KV cache, completion tokens, the
worker's prefill and decode seconds, whether a generation runs and how many wait). Names follow
Prometheus' conventions (sharpi_ prefix, _total counters, base units), beside llama-server's
llamacpp: names in spirit (prompt/predicted tokens and seconds, requests processing/deferred).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .scheduler import Engine

# (count key, metric name without _total, help) of Engine.counts turned into counters.
_ENGINE_COUNTERS = (
    ("requests", "sharpi_generations", "generations finished (completed, stopped or cancelled)"),
    ("cancelled", "sharpi_generations_cancelled", "generations stopped early (a client left, a stop string)"),
    ("prompt_tokens_prefilled", "sharpi_prompt_tokens_prefilled", "prompt tokens decoded (prefill)"),
    ("prompt_tokens_reused", "sharpi_prompt_tokens_reused", "prompt tokens the KV cache already held"),
    ("completion_tokens", "sharpi_completion_tokens", "tokens generated"),
    ("prompt_seconds", "sharpi_prompt_seconds", "worker seconds from a generation's start to its first text"),
    ("decode_seconds", "sharpi_decode_seconds", "worker seconds from a generation's first text to its end"),
)


class _EngineCollector:
    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        snap = self.engine.snapshot()
        for key, name, doc in _ENGINE_COUNTERS:
            yield CounterMetricFamily(name, doc, value=snap[key])
        yield GaugeMetricFamily("sharpi_requests_processing", "generations running now (0 or 1)",
                                value=int(snap["busy"]))
        yield GaugeMetricFamily("sharpi_requests_waiting", "generations queued behind the running one",
                                value=snap["waiting"])
        yield GaugeMetricFamily("sharpi_context_tokens", "the context (n_ctx) in tokens", value=self.engine.n_ctx)


class ServerMetrics:
    """The registry behind /metrics and the HTTP request metrics access.py records."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: Engine):
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("sharpi_http_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=self.registry)
        self.latency = Histogram("sharpi_http_request_duration_seconds",
                                 "from a request's arrival to the end of its response, by route", ["route"],
                                 buckets=(0.005, 0.025, 0.1, 0.5, 1, 2.5, 10, 30, 60, 120, 300),
                                 registry=self.registry)
        self.registry.register(_EngineCollector(engine))

    def observe(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route=route, status=str(status)).inc()
        self.latency.labels(route=route).observe(seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)
