"""sharpi.metrics: its counter names against the keys the engine returns, and its ratios against
arithmetic written out here.

Oracle for the names: Session.expert_stats() of a streamed session (the dict the bindings build from
the C++ ExpertCacheStats), so the one Python list and the C++ list cannot drift apart silently.
"""

from __future__ import annotations

import pytest
import sharpi
from sharpi import metrics
from sharpi.models import default_model_path


@pytest.fixture(scope="module")
def streamed_stats() -> dict:
    """expert_stats() of the shipped model streamed under a budget, after a few decoded tokens."""
    session = sharpi.Session(default_model_path(), threads=1, n_ctx=64, ram_budget="1GiB", reader="pread")
    session.decode(list(range(5, 13)))
    session.decode([7])
    stats = session.expert_stats()
    session.close()
    return stats


def test_top_level_names_are_the_engines(streamed_stats):
    assert set(streamed_stats) == set(metrics.EXPERT_STATS_KEYS)
    assert len(metrics.EXPERT_STATS_KEYS) == len(set(metrics.EXPERT_STATS_KEYS))


def test_layer_counter_names_are_the_engines(streamed_stats):
    layers = streamed_stats["layers"]
    assert layers, "a session with a RAM budget streams: one entry per MoE layer"
    for layer in layers:
        assert set(layer) == set(metrics.LAYER_COUNTERS)
    assert len(metrics.LAYER_COUNTERS) == len(set(metrics.LAYER_COUNTERS))
    # The groups partition the per-layer counters.
    groups = metrics.CACHE_COUNTERS + metrics.PREFETCH_COUNTERS + metrics.PREDICTION_COUNTERS
    assert sorted(groups) == sorted(metrics.LAYER_COUNTERS)


def test_summary_of_the_engines_stats(streamed_stats):
    doc = metrics.summarise(streamed_stats, top_k=2)
    total = doc["total"]
    layers = streamed_stats["layers"]
    hits = sum(lay["hits"] for lay in layers)
    accesses = sum(lay["accesses"] for lay in layers)
    assert accesses > 0 and total["hit_rate"] == hits / accesses
    assert total["io_bytes"] == sum(lay["bytes_read"] for lay in layers)
    assert set(metrics.LAYER_METRICS) <= set(doc["layers"][0])
    assert set(metrics.LAYER_METRICS + metrics.TOTAL_METRICS + metrics.GLOBAL_TIMES) <= set(total)


def test_ratios_by_hand():
    assert metrics.hit_rate(3, 4) == 0.75 and metrics.hit_rate(0, 0) is None
    assert metrics.recall_at_k(5, 4, 2) == 5 / 8
    assert metrics.recall_at_k(5, 4, None) is None and metrics.recall_at_k(0, 0, 2) is None
    assert metrics.precision(5, 7) == 5 / 7 and metrics.precision(0, 0) is None
    assert metrics.gbps(2e9, 0.5) == 4.0 and metrics.gbps(1, 0) is None
    assert metrics.overlap(25.0, 100.0) == 0.75 and metrics.overlap(1.0, 0.0) is None
    assert metrics.predict_overhead(1.0, 4.0) == 0.25 and metrics.predict_overhead(1.0, 0) is None
    assert metrics.compute_ms(10.0, 4.0) == 6.0 and metrics.compute_ms(0.0, 4.0) is None
    assert metrics.counter({"a": None}, "a") == 0 and metrics.counter(None, "a") == 0


def test_summarise_sums_first_then_divides():
    layers = [
        {"hits": 1, "misses": 3, "bytes_read": 100, "stall_ms": 2.0},  # the rest missing: 0
        {"hits": 3, "misses": 1, "bytes_read": 300, "stall_ms": 6.0, "predictions": 2, "predicted_correct": 3},
    ]
    doc = metrics.summarise({"layers": layers, "io_busy_ms": 0.0}, top_k=2, io_busy_fallback=(16.0, "timeline"))
    assert [lay["hit_rate"] for lay in doc["layers"]] == [0.25, 0.75]
    t = doc["total"]
    assert t["hits"] == 4 and t["misses"] == 4 and t["hit_rate"] == 0.5
    assert t["recall_at_k"] == 3 / 4 and t["precision"] is None
    assert t["io_busy_ms"] == 16.0 and t["io_busy_source"] == "timeline"
    assert t["io_gbps"] == 400 / 0.016 / 1e9 and t["overlap"] == 1 - 8.0 / 16.0
    assert t["compute_ms"] is None and t["predict_overhead"] is None
    assert metrics.summarise({"layers": layers, "io_busy_ms": 5.0}, io_busy_fallback=(16.0, "timeline"))[
        "total"
    ]["io_busy_source"] == "expert_stats"
