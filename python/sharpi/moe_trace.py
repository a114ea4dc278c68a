"""The MoE tracing report (docs/design.md §7): expert-cache, prefetch and predictor metrics per layer and in
total, per-request latency, and a Chrome/Perfetto timeline.

What it owns: the per-request latency summary, the human table printed to `stream`, and two files
in `out_dir`: moe_trace.json (the summary) and moe_trace_timeline.json (trace-event JSON written by
sharpi.timeline, one lane per compute thread and per reader queue). The counter names and the
arithmetic of every cache / prefetch / predictor metric (hit_rate, recall_at_k, precision, io_gbps,
overlap, predict_overhead, ...) are sharpi.metrics'; this module applies them. It never talks to the
engine and never changes the counters: callers pass plain dicts, so the report can be recomputed
from saved stats. Missing keys count as 0; a ratio whose denominator is 0 is None (JSON null, "-"
in the table), never a division error.

io_busy_ms comes from expert_stats["io_busy_ms"]; when the engine does not report it and a
timeline is given, it is the length of the union of the reader tracks' spans (io_busy_source says
which). top_k comes from expert_stats ("top_k" or "n_expert_used"), else from the constructor.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence

from . import metrics
from .timeline import write_chrome_trace


def _reader_busy_ms(events: Sequence[Mapping]) -> float:
    """Milliseconds during which at least one read was in flight: the union of the spans of every
    track whose name starts with "reader" (overlapping reads count once)."""
    spans = sorted(
        (float(e["start_us"]), float(e["start_us"]) + float(e["dur_us"]))
        for e in events
        if str(e.get("track", "")).startswith("reader")
    )
    busy_us, cur_start, cur_end = 0.0, None, None
    for start, end in spans:
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                busy_us += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        busy_us += cur_end - cur_start
    return busy_us / 1e3


class MoeTracer:
    """Collects per-request timings, then builds, prints and writes the MoE tracing report."""

    def __init__(self, out_dir: str | None, stream="stderr", top_k: int | None = None):
        """out_dir: folder for moe_trace.json and moe_trace_timeline.json (created on finish); None
        writes no files. stream: where finish() prints the table ("stderr": sys.stderr as it is when
        finish() runs; None: nowhere). top_k: the model's experts per token, used when expert_stats
        does not carry it."""
        self.out_dir = None if out_dir is None else os.fspath(out_dir)
        self.stream = stream
        self.top_k = top_k
        self.requests: list = []

    def add_request(self, stats: Mapping) -> None:
        """One request's Session.last_stats (ttft_s, tpot_s, prefill_tok_s, decode_tok_s, n_prompt,
        n_generated, prefill_s, decode_s; missing = 0)."""
        self.requests.append(
            {
                "n_prompt": int(metrics.counter(stats, "n_prompt")),
                "n_generated": int(metrics.counter(stats, "n_generated")),
                "prefill_s": float(metrics.counter(stats, "prefill_s")),
                "decode_s": float(metrics.counter(stats, "decode_s")),
                "ttft_ms": float(metrics.counter(stats, "ttft_s")) * 1e3,
                "tpot_ms": float(metrics.counter(stats, "tpot_s")) * 1e3,
                "prefill_tok_s": float(metrics.counter(stats, "prefill_tok_s")),
                "decode_tok_s": float(metrics.counter(stats, "decode_tok_s")),
            }
        )

    def summary(self, expert_stats: Mapping, timeline_events: Sequence[Mapping] = ()) -> dict:
        """The report as a dict: {top_k, layers: [...], total: {...}, requests: [...],
        requests_total: {...}}. Pure arithmetic on its arguments and the added requests."""
        expert_stats = expert_stats or {}
        busy_ms = 0.0
        if metrics.counter(expert_stats, "io_busy_ms") <= 0 and timeline_events:
            busy_ms = _reader_busy_ms(timeline_events)
        doc = metrics.summarise(expert_stats, self.top_k, io_busy_fallback=(busy_ms, "timeline"))

        reqs = self.requests
        n_prompt = sum(r["n_prompt"] for r in reqs)
        prefill_s = sum(r["prefill_s"] for r in reqs)
        decode_steps = sum(max(r["n_generated"] - 1, 0) for r in reqs)
        decode_s = sum(r["decode_s"] for r in reqs)
        requests_total = {
            "requests": len(reqs),
            "ttft_ms_mean": metrics.ratio(sum(r["ttft_ms"] for r in reqs), len(reqs)),
            # TPOT over all decode steps of all requests (a long request weighs by its steps).
            "tpot_ms": metrics.ratio(decode_s * 1e3, decode_steps),
            "prefill_tok_s": metrics.ratio(n_prompt, prefill_s),
            "decode_tok_s": metrics.ratio(decode_steps, decode_s),
        }
        return {
            **doc,
            "requests": [dict(r) for r in reqs],
            "requests_total": requests_total,
        }

    def finish(self, expert_stats: Mapping, timeline_events: Sequence[Mapping] = ()) -> dict:
        """summary(), printed as a table to `stream` and, with an out_dir, written as moe_trace.json
        plus moe_trace_timeline.json. Returns the summary (with "files" naming what was written)."""
        doc = self.summary(expert_stats, timeline_events)
        if self.out_dir is not None:
            os.makedirs(self.out_dir, exist_ok=True)
            timeline_path = os.path.join(self.out_dir, "moe_trace_timeline.json")
            tl = write_chrome_trace(
                list(timeline_events or []), timeline_path, process_name="sharpi moe trace"
            )
            json_path = os.path.join(self.out_dir, "moe_trace.json")
            doc["files"] = {"summary": json_path, "timeline": tl["path"]}
            doc["timeline"] = {"n_events": tl["n_events"], "lanes": tl["lanes"]}
            with open(json_path, "w") as f:
                json.dump(doc, f, indent=1)
        stream = sys.stderr if isinstance(self.stream, str) else self.stream
        if stream is not None:
            stream.write(format_table(doc))
            stream.flush()
        return doc


def _f(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(doc: dict) -> str:
    """The human table of a summary(): one row per layer, the total, the IO line, the requests."""
    MiB = float(1 << 20)
    head = (
        f"{'layer':>5} {'hits':>8} {'misses':>8} {'hit':>6} {'recall@k':>8} {'prec':>6} {'issued':>7} "
        f"{'used':>7} {'timely':>7} {'late':>6} {'wasteMiB':>8} {'skipped':>7} {'dropped':>7} "
        f"{'stall ms':>9} {'io MiB':>9}"
    )

    def row(name: str, m: dict) -> str:
        return (
            f"{name:>5} {m['hits']:>8.0f} {m['misses']:>8.0f} {_f(m['hit_rate'], '.3f'):>6} "
            f"{_f(m['recall_at_k'], '.3f'):>8} {_f(m['precision'], '.3f'):>6} {m['prefetch_issued']:>7.0f} "
            f"{m['prefetch_used']:>7.0f} {m['prefetch_timely']:>7.0f} {m['prefetch_late']:>6.0f} "
            f"{m['prefetch_wasted_bytes'] / MiB:>8.1f} {m['prefetch_skipped']:>7.0f} {m['hints_dropped']:>7.0f} "
            f"{m['stall_ms']:>9.1f} {m['io_bytes'] / MiB:>9.1f}"
        )

    lines = [f"MoE trace (top-{_f(doc['top_k'], 'd')})", head]
    lines += [row(str(m["layer"]), m) for m in doc["layers"]]
    t = doc["total"]
    lines.append(row("total", t))
    lines.append(
        f"io busy {t['io_busy_ms']:.1f} ms ({t['io_busy_source']}) | io {_f(t['io_gbps'], '.2f')} GB/s | "
        f"decode {t['decode_ms']:.1f} ms | compute {_f(t['compute_ms'], '.1f')} ms | "
        f"stall {t['stall_ms']:.1f} ms | overlap {_f(t['overlap'], '.3f')} | "
        f"predict {t['predict_ms']:.1f} ms ({_f(t['predict_overhead'] and t['predict_overhead'] * 100, '.1f')}% of decode)"
    )
    if doc["requests"]:
        lines.append(
            f"{'request':>7} {'prompt':>7} {'gen':>5} {'TTFT ms':>9} {'TPOT ms':>9} {'prefill tok/s':>13} {'decode tok/s':>12}"
        )
        for i, r in enumerate(doc["requests"]):
            lines.append(
                f"{i:>7} {r['n_prompt']:>7} {r['n_generated']:>5} {r['ttft_ms']:>9.1f} {r['tpot_ms']:>9.1f} "
                f"{r['prefill_tok_s']:>13.1f} {r['decode_tok_s']:>12.1f}"
            )
        rt = doc["requests_total"]
        lines.append(
            f"{'all':>7} {'':>7} {'':>5} {_f(rt['ttft_ms_mean'], '9.1f')} {_f(rt['tpot_ms'], '9.1f')} "
            f"{_f(rt['prefill_tok_s'], '13.1f')} {_f(rt['decode_tok_s'], '12.1f')}  (TTFT: mean; rates over all tokens)"
        )
    files = doc.get("files")
    if files:
        lines.append(f"wrote {files['summary']} and {files['timeline']} (open in ui.perfetto.dev)")
    return "\n".join(lines) + "\n"
