"""GET /metrics: Prometheus text (prometheus_client), one registry per application.

Two kinds of metric: HTTP requests (counted by access.py as each response ends: by route and
status, and a latency histogram by route), and the engine's own counts (Engine.snapshot(), read
at scrape time by a collector, so they are never copied or double-counted: finished generations,
cancelled ones (those cancelled while still queued among them), requests refused with a full
queue, prompt tokens prefilled and reused from the KV cache, completion tokens, the worker's
prefill and decode seconds, the slots, how many run a generation and how many wait, the steps and
histograms of the tokens and sequences each decoded, and the expert cache's reads: accesses, hits
and bytes read from the file, with the hit rate and the bytes per step and per generated token
they give. The expert counts are sampled by the worker between steps (at most every 0.1 s and at
the end of each busy period), so they may trail the step count by a tenth of a second; all zero
when every expert is resident. Names follow Prometheus' conventions (sharpi_ prefix, _total
counters, base units), beside llama-server's llamacpp: names in spirit (prompt/predicted tokens
and seconds, requests processing/deferred).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .scheduler import Engine

# (count key, metric name without _total, help) of Engine.counts turned into counters.
_ENGINE_COUNTERS = (
    ("requests", "sharpi_generations", "generations finished (completed, stopped or cancelled)"),
    ("cancelled", "sharpi_generations_cancelled", "generations stopped early (a client left, a stop string)"),
    ("cancelled_queued", "sharpi_generations_cancelled_queued",
     "generations cancelled while queued, before a slot took them (among the cancelled)"),
    ("rejected", "sharpi_requests_rejected", "generations refused with 503: the queue was full"),
    ("prompt_tokens_prefilled", "sharpi_prompt_tokens_prefilled", "prompt tokens decoded (prefill)"),
    ("prompt_tokens_reused", "sharpi_prompt_tokens_reused", "prompt tokens the KV cache already held"),
    ("completion_tokens", "sharpi_completion_tokens", "tokens generated"),
    ("prompt_seconds", "sharpi_prompt_seconds", "worker seconds from a generation's start to its first text"),
    ("decode_seconds", "sharpi_decode_seconds", "worker seconds from a generation's first text to its end"),
    ("steps", "sharpi_steps", "decode steps run (one forward pass over every busy slot)"),
    ("expert_accesses", "sharpi_expert_accesses", "expert uses by decoded tokens (streamed experts only)"),
    ("expert_hits", "sharpi_expert_hits", "expert uses served from the expert cache (streamed experts only)"),
    ("expert_bytes_read", "sharpi_expert_read_bytes", "expert bytes read from the model file"),
    ("draft_tokens", "sharpi_draft_tokens", "speculative draft tokens verified (--spec-type)"),
    ("draft_tokens_accepted", "sharpi_draft_tokens_accepted", "speculative draft tokens accepted"),
)


class _EngineCollector:
    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        snap = self.engine.snapshot()
        for key, name, doc in _ENGINE_COUNTERS:
            yield CounterMetricFamily(name, doc, value=snap[key])
        yield GaugeMetricFamily("sharpi_requests_processing", "generations running now (slots busy)",
                                value=snap["active"])
        yield GaugeMetricFamily("sharpi_requests_waiting", "generations queued for a free slot",
                                value=snap["waiting"])
        yield GaugeMetricFamily("sharpi_slots", "slots (--parallel): generations decoded at once",
                                value=snap["slots"])
        yield GaugeMetricFamily("sharpi_queue_size", "generations that may wait for a slot (--queue-size)",
                                value=snap["queue_size"])
        yield GaugeMetricFamily("sharpi_context_tokens", "the context (n_ctx) of each slot in tokens",
                                value=self.engine.n_ctx)
        docs = {"tokens": "tokens one step decoded (prompt chunks and generated tokens of all slots)",
                "sequences": "sequences (busy slots) one step decoded"}
        for key, (buckets, total) in self.engine.step_histogram_values().items():
            yield HistogramMetricFamily(f"sharpi_step_{key}", docs[key], buckets=buckets, sum_value=total)
        accesses, steps, generated = snap["expert_accesses"], snap["steps"], snap["completion_tokens"]
        read = snap["expert_bytes_read"]
        yield GaugeMetricFamily("sharpi_expert_hit_rate", "expert cache hits / accesses since the start "
                                "(1 when every expert is resident)",
                                value=snap["expert_hits"] / accesses if accesses else 1.0)
        yield GaugeMetricFamily("sharpi_expert_read_bytes_per_step", "expert bytes read per step since the start",
                                value=read / steps if steps else 0.0)
        yield GaugeMetricFamily("sharpi_expert_read_bytes_per_token", "expert bytes read (prefill included) per "
                                "generated token since the start", value=read / generated if generated else 0.0)


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
