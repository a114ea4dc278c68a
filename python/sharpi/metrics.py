"""The names of the MoE counters and the arithmetic of every metric derived from them (docs/design.md §7).

What it owns: the one Python list of the keys Session.expert_stats() returns (the engine's
ExpertCacheStats and LayerExpertStats, cpp/include/sharpi/types.h, turned into a dict by
python/sharpi/bindings/expert_stats.cpp) and the one definition of each derived metric.
sharpi.moe_trace (the tracing report), sharpi.cli (the cache summary line and --expert-stats JSON)
and sharpi.bench (the streaming benchmark) import it; none of them spells a counter name or a
ratio of its own. tests/test_metrics.py checks these names against the keys the engine returns, so
the C++ list and this one cannot drift apart.

Pure functions on numbers and plain dicts: no I/O, no engine calls, nothing imported from sharpi.
Missing counters count as 0 (the engine grows counters over time); a ratio whose denominator is 0
is None (JSON null, "-" in tables), never a division error.

Definitions (per layer and in total; a total sums the per-layer counters first, then divides):
  accesses         = hits + misses                   (the engine counts both; demand acquisitions)
  hit_rate         = hits / accesses
  recall_at_k      = predicted_correct / (predictions * top_k)   (prediction set size = k)
  precision        = predicted_correct / predicted_experts
  io_bytes         = bytes_read
  io_gbps          = io_bytes / io_busy_ms            (total only: io_busy_ms is global)
  compute_ms       = decode_ms - stall_ms             (total only)
  overlap          = 1 - stall_ms / io_busy_ms        (total only)
  predict_overhead = predict_ms / decode_ms           (total only)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

# ---- raw counters: the keys of Session.expert_stats() ---------------------------------------------

# The cache's tier ("ram"; "vram" for the device tier's counters, same names), plan and reader (top level).
CACHE_PLAN = (
    "tier",
    "reader",
    "reader_detail",
    "reader_note",
    "n_slots",
    "n_staging",
    "slot_bytes",
    "budget_bytes",
    "fixed_bytes",
)
# Per MoE layer, expert_stats()["layers"][il]: demand traffic of the expert cache ...
CACHE_COUNTERS = ("accesses", "hits", "misses", "evictions", "bytes_read", "stall_ms")
# ... the prefetcher's reads and the hints it could not act on ...
PREFETCH_COUNTERS = (
    "prefetch_issued",
    "prefetch_used",
    "prefetch_timely",
    "prefetch_late",
    "prefetch_wasted_bytes",
    "prefetch_skipped",
    "hints_dropped",
)
# ... and the quality of the prediction sets made for the layer.
PREDICTION_COUNTERS = ("predictions", "predicted_correct", "predicted_experts")
LAYER_COUNTERS = CACHE_COUNTERS + PREFETCH_COUNTERS + PREDICTION_COUNTERS
# Per (layer, expert), flat arrays indexed il * n_expert + e (top level).
EXPERT_COUNTERS = ("expert_accesses", "expert_misses")
# Times of the whole session (top level, milliseconds).
GLOBAL_TIMES = ("io_busy_ms", "decode_ms", "predict_ms")
# Predictor calls (top level).
PREDICTOR_COUNTERS = ("predictor_calls", "predictor_failures")
# The VRAM tier's misses computed on the CPU, and the miss cost model's inputs that routed them
# (bytes/s, seconds; 0 on the RAM tier, where every miss is read).
MISS_ROUTE = ("cpu_experts", "miss_copy_bytes_per_s", "miss_copy_latency_s", "miss_cpu_bytes_per_s")
# Every top-level key of Session.expert_stats().
EXPERT_STATS_KEYS = CACHE_PLAN + ("layers",) + EXPERT_COUNTERS + GLOBAL_TIMES + PREDICTOR_COUNTERS + MISS_ROUTE

# ---- derived metrics --------------------------------------------------------------------------------

# Added to each layer's counters (and to the total) by layer_metrics().
LAYER_METRICS = ("io_bytes", "hit_rate", "recall_at_k", "precision")
# Added to the total only by summarise(): they need the session-wide times.
TOTAL_METRICS = ("io_busy_source", "io_gbps", "compute_ms", "overlap", "predict_overhead")


def counter(d: Mapping | None, key: str):
    """d[key], with a missing key, a None value or a missing d counted as 0."""
    value = d.get(key, 0) if d else 0
    return 0 if value is None else value


def ratio(num: float, den: float):
    """num / den, or None when den is 0."""
    return num / den if den else None


def hit_rate(hits: float, accesses: float):
    """hits / accesses (accesses = hits + misses), None without accesses."""
    return ratio(hits, accesses)


def recall_at_k(predicted_correct: float, predictions: float, top_k: int | None):
    """predicted_correct / (predictions * top_k): the share of the selected experts the prediction
    sets named. None without predictions or without a known top_k."""
    return ratio(predicted_correct, predictions * top_k) if top_k else None


def precision(predicted_correct: float, predicted_experts: float):
    """predicted_correct / predicted_experts: the share of predicted experts the gate selected."""
    return ratio(predicted_correct, predicted_experts)


def gbps(nbytes: float, seconds: float):
    """nbytes / seconds in GB/s (1e9 bytes), None when seconds <= 0."""
    return nbytes / seconds / 1e9 if seconds > 0 else None


def overlap(stall_ms: float, io_busy_ms: float):
    """1 - stall_ms / io_busy_ms: the share of read time hidden behind compute."""
    stall_over_busy = ratio(stall_ms, io_busy_ms)
    return None if stall_over_busy is None else 1.0 - stall_over_busy


def predict_overhead(predict_ms: float, decode_ms: float):
    """predict_ms / decode_ms: the share of decode time spent predicting and prefetching."""
    return ratio(predict_ms, decode_ms)


def compute_ms(decode_ms: float, stall_ms: float):
    """decode_ms - stall_ms: decode time not spent waiting on reads; None without decode_ms."""
    return decode_ms - stall_ms if decode_ms > 0 else None


def sum_layers(layers: Iterable[Mapping], keys: Iterable[str] = LAYER_COUNTERS) -> dict:
    """{key: sum over layers} of the per-layer counters (missing = 0)."""
    keys = tuple(keys)
    totals = {key: 0 for key in keys}
    for layer in layers:
        for key in keys:
            totals[key] += counter(layer, key)
    return totals


def layer_metrics(counters: Mapping, top_k: int | None) -> dict:
    """The counters of one layer (or their sums) with LAYER_METRICS added."""
    out = dict(counters)
    out["io_bytes"] = counters["bytes_read"]
    out["hit_rate"] = hit_rate(counters["hits"], counters["hits"] + counters["misses"])
    out["recall_at_k"] = recall_at_k(counters["predicted_correct"], counters["predictions"], top_k)
    out["precision"] = precision(counters["predicted_correct"], counters["predicted_experts"])
    return out


def summarise(
    expert_stats: Mapping | None, top_k: int | None = None, io_busy_fallback: tuple = (0.0, "none")
) -> dict:
    """Every metric of one Session.expert_stats() (or a dict of the same shape, missing keys = 0):
    {top_k, layers: [{layer, counters..., LAYER_METRICS...}], total: {counter sums, LAYER_METRICS,
    GLOBAL_TIMES, TOTAL_METRICS}}.

    top_k: the experts per token, from expert_stats ("top_k" or "n_expert_used") when it carries
    one, else this argument. io_busy_fallback: (milliseconds, source name) used as io_busy_ms when
    expert_stats reports none (e.g. measured from a timeline); total["io_busy_source"] names where
    io_busy_ms came from ("expert_stats", the fallback's source, or "none")."""
    expert_stats = expert_stats or {}
    top_k = expert_stats.get("top_k") or expert_stats.get("n_expert_used") or top_k
    top_k = int(top_k) if top_k else None
    raw_layers = expert_stats.get("layers", []) or []
    layers = [
        {"layer": il, **layer_metrics({key: counter(raw, key) for key in LAYER_COUNTERS}, top_k)}
        for il, raw in enumerate(raw_layers)
    ]
    total = layer_metrics(sum_layers(raw_layers), top_k)
    times = {key: float(counter(expert_stats, key)) for key in GLOBAL_TIMES}
    io_busy_source = "expert_stats" if times["io_busy_ms"] > 0 else "none"
    fallback_ms, fallback_source = io_busy_fallback
    if times["io_busy_ms"] <= 0 and fallback_ms > 0:
        times["io_busy_ms"], io_busy_source = fallback_ms, fallback_source
    total.update(times)
    total["io_busy_source"] = io_busy_source
    total["io_gbps"] = gbps(total["io_bytes"], times["io_busy_ms"] / 1e3)
    total["compute_ms"] = compute_ms(times["decode_ms"], total["stall_ms"])
    total["overlap"] = overlap(total["stall_ms"], times["io_busy_ms"])
    total["predict_overhead"] = predict_overhead(times["predict_ms"], times["decode_ms"])
    return {"top_k": top_k, "layers": layers, "total": total}
