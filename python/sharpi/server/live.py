"""The live view of `sharpi serve` (the page at /, fed by GET /v1/sharpi/stats): the expert cache's
counters (Session.expert_stats, docs/design.md §7 names) turned into what the page plots while tokens
stream, per layer (hit rate, prefetch recall@k, stall and bytes read per token, since the current
request began) and over time (one point per sample: the same four totals and tokens/s).

Who calls what: the serve worker thread samples the Session between steps (observe(), at most
every `interval_s`, and always at the end of a busy period), since only that thread may call the
Session; the event loop reads view(). Both under one lock; view() copies. Never touches a Session.
A "token" here is a position decoded (prompt tokens prefilled and answer tokens decoded alike, of
every slot). A "request" of begin_request is a busy period of the scheduler: from a Job starting
on an idle server to the moment no slot runs one (with --parallel 1, exactly one request).
"""

from __future__ import annotations

import threading
import time
from collections import deque

# The per-layer counters the view differences (fields of Session.expert_stats()["layers"][il]).
_FIELDS = ("accesses", "hits", "bytes_read", "stall_ms", "predictions", "predicted_correct")


def _layer_counts(stats: dict) -> list:
    return [tuple(float(layer[f]) for f in _FIELDS) for layer in stats["layers"]]


def _rates(now: list, then: list, n_tokens: float, top_k: int) -> dict:
    """Per-layer rates between two samples of _layer_counts over n_tokens decoded positions:
    hit_rate = hits / accesses, recall = predicted_correct / (predictions * top_k) (None where
    nothing was demanded or predicted), stall ms and bytes read per token."""
    out: dict = {"hit_rate": [], "recall": [], "stall_ms_per_token": [], "bytes_per_token": []}
    for a, b in zip(now, then):
        d = dict(zip(_FIELDS, (x - y for x, y in zip(a, b))))
        out["hit_rate"].append(d["hits"] / d["accesses"] if d["accesses"] else None)
        out["recall"].append(d["predicted_correct"] / (d["predictions"] * top_k) if d["predictions"] else None)
        out["stall_ms_per_token"].append(d["stall_ms"] / n_tokens if n_tokens else 0.0)
        out["bytes_per_token"].append(d["bytes_read"] / n_tokens if n_tokens else 0.0)
    return out


def _total(per_layer: list, weights: list):
    """The weighted mean of per-layer rates (None entries left out), None when all are."""
    pairs = [(r, w) for r, w in zip(per_layer, weights) if r is not None and w]
    total_w = sum(w for _, w in pairs)
    return sum(r * w for r, w in pairs) / total_w if total_w else None


class LiveStats:
    """Samples of one Session's expert-cache counters (see the module docstring)."""

    def __init__(self, top_k: int, max_points: int = 300, interval_s: float = 0.1):
        self.top_k, self.interval_s = top_k, interval_s
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._series: deque = deque(maxlen=max_points)
        self._tokens = 0  # positions decoded since the server started (worker's count)
        self._last: tuple | None = None  # (time, tokens, layer counts) of the previous sample
        self._request_start: tuple | None = None  # (tokens, layer counts) when this request began
        self._layers: dict = {}
        self._cache: dict = {"streaming": False}
        self._sampled = False  # whether this request has a sample yet (its first comes at once)
        self.n_samples = 0

    def begin_request(self, stats: dict) -> None:
        """The worker starts a request: per-layer rates count from here."""
        counts = _layer_counts(stats)
        with self._lock:
            self._request_start = (self._tokens, counts)
            self._sampled = False
            if self._last is None:
                self._last = (time.perf_counter(), self._tokens, counts)
            self._cache = {"streaming": bool(stats["layers"]), "reader": stats["reader"],
                           "n_slots": stats["n_slots"], "slot_bytes": stats["slot_bytes"],
                           "budget_bytes": stats["budget_bytes"], "n_layer": len(stats["layers"]),
                           "top_k": self.top_k}

    def add_tokens(self, n: int) -> None:
        """n more positions decoded (worker thread)."""
        with self._lock:
            self._tokens += n

    def due(self) -> bool:
        """Whether to sample now: at a request's first token (its prefill shows at once), then
        once the interval since the last sample has passed."""
        return not self._sampled or self._last is None or time.perf_counter() - self._last[0] >= self.interval_s

    def observe(self, stats: dict) -> None:
        """A sample of Session.expert_stats() taken between tokens; adds a series point when
        positions were decoded since the last one."""
        now = time.perf_counter()
        counts = _layer_counts(stats)
        with self._lock:
            if self._last is None or self._request_start is None:
                return
            t_prev, tokens_prev, counts_prev = self._last
            n = self._tokens - tokens_prev
            if n <= 0:
                return
            step = _rates(counts, counts_prev, n, self.top_k)
            accesses = [a[0] - b[0] for a, b in zip(counts, counts_prev)]
            predictions = [a[4] - b[4] for a, b in zip(counts, counts_prev)]
            self._series.append({
                "t": now - self._t0,
                "tokens": n,
                "tok_per_s": n / (now - t_prev) if now > t_prev else 0.0,
                "hit_rate": _total(step["hit_rate"], accesses),
                "recall": _total(step["recall"], predictions),
                "stall_ms_per_token": sum(step["stall_ms_per_token"]),
                "bytes_per_token": sum(step["bytes_per_token"]),
            })
            self._last = (now, self._tokens, counts)
            tokens0, counts0 = self._request_start
            self._layers = _rates(counts, counts0, self._tokens - tokens0, self.top_k)
            self._sampled = True
            self.n_samples += 1

    def view(self) -> dict:
        with self._lock:
            return {"cache": dict(self._cache), "tokens": self._tokens, "samples": self.n_samples,
                    "layers": {k: list(v) for k, v in self._layers.items()}, "series": list(self._series)}
