"""sharpi.moe_trace (the docs/design.md §7 report) against arithmetic written out here.

Inputs are hand-made expert_stats dicts with seeded random counters (the shape of
Session.expert_stats()), so every metric is checked against its definition computed independently
in the test (float sums per layer, then docs/design.md §7's formulas); the reader-busy fallback
against a brute-force count over a microsecond grid; the timeline file with a trace-event structure
check.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from sharpi.metrics import LAYER_COUNTERS as COUNTERS  # the counters the report reads
from sharpi.moe_trace import MoeTracer, format_table


def random_stats(rng, n_layer: int, top_k: int, with_new_keys: bool = True) -> dict:
    layers = []
    for _ in range(n_layer):
        hits, misses = int(rng.integers(0, 500)), int(rng.integers(0, 500))
        predictions = int(rng.integers(1, 100))
        issued = int(rng.integers(0, 200))
        used = int(rng.integers(0, issued + 1))
        timely = int(rng.integers(0, used + 1))
        lay = {
            "accesses": hits + misses,
            "hits": hits,
            "misses": misses,
            "evictions": int(rng.integers(0, misses + 1)),
            "bytes_read": int(rng.integers(0, 1 << 30)),
            "stall_ms": float(rng.uniform(0, 50)),
            "prefetch_issued": issued,
            "prefetch_used": used,
            "prefetch_timely": timely,
            "prefetch_late": used - timely,
            "prefetch_wasted_bytes": int(rng.integers(0, 1 << 26)),
        }
        if with_new_keys:
            lay.update(
                {
                    "predictions": predictions,
                    "predicted_correct": int(rng.integers(0, predictions * top_k + 1)),
                    "predicted_experts": predictions * top_k - int(rng.integers(0, predictions)),
                    "hints_dropped": int(rng.integers(0, 5)),
                    "prefetch_skipped": int(rng.integers(0, 30)),
                }
            )
        layers.append(lay)
    stats = {"reader": "pread", "n_slots": 10, "layers": layers}
    if with_new_keys:
        stats.update(
            {
                "io_busy_ms": float(rng.uniform(100, 400)),
                "decode_ms": float(rng.uniform(500, 2000)),
                "predict_ms": float(rng.uniform(1, 20)),
                "top_k": top_k,
            }
        )
    return stats


def expected_metrics(lay: dict, top_k: int) -> dict:
    get = lambda k: float(lay.get(k, 0))
    hm = get("hits") + get("misses")
    return {
        "hit_rate": get("hits") / hm if hm else None,
        "recall_at_k": get("predicted_correct") / (get("predictions") * top_k)
        if get("predictions")
        else None,
        "precision": get("predicted_correct") / get("predicted_experts")
        if get("predicted_experts")
        else None,
        "io_bytes": get("bytes_read"),
    }


def assert_close(a, b, what):
    if b is None:
        assert a is None, f"{what}: {a} instead of None"
    else:
        assert a is not None and a == pytest.approx(b, rel=1e-12, abs=1e-12), f"{what}: {a} vs {b}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_summary_arithmetic_against_the_definitions(seed):
    rng = np.random.default_rng(seed)
    top_k = int(rng.integers(1, 9))
    stats = random_stats(rng, int(rng.integers(1, 30)), top_k)
    tracer = MoeTracer(None, stream=None)
    s = tracer.summary(stats, [])
    assert s["top_k"] == top_k and len(s["layers"]) == len(stats["layers"])
    for il, (lay, got) in enumerate(zip(stats["layers"], s["layers"])):
        assert got["layer"] == il
        for key in COUNTERS:
            assert got[key] == lay.get(key, 0), (il, key)
        for key, want in expected_metrics(lay, top_k).items():
            assert_close(got[key], want, f"layer {il} {key}")
    total = {key: sum(float(lay.get(key, 0)) for lay in stats["layers"]) for key in COUNTERS}
    t = s["total"]
    for key in COUNTERS:
        assert t[key] == pytest.approx(total[key], rel=1e-12), key
    for key, want in expected_metrics(total, top_k).items():
        assert_close(t[key], want, f"total {key}")
    io_busy, decode, predict = stats["io_busy_ms"], stats["decode_ms"], stats["predict_ms"]
    assert t["io_busy_source"] == "expert_stats"
    assert_close(t["io_gbps"], total["bytes_read"] / (io_busy / 1000) / 1e9, "io_gbps")
    assert_close(t["compute_ms"], decode - total["stall_ms"], "compute_ms")
    assert_close(t["overlap"], 1 - total["stall_ms"] / io_busy, "overlap")
    assert_close(t["predict_overhead"], predict / decode, "predict_overhead")


def test_hand_worked_example():
    # Two layers, top-2. Layer 0: 3 hits / 1 miss; 4 predictions of 2 experts, 5 right, 7 predicted.
    stats = {
        "n_expert_used": 2,
        "io_busy_ms": 20.0,
        "decode_ms": 100.0,
        "predict_ms": 5.0,
        "layers": [
            {"hits": 3, "misses": 1, "predictions": 4, "predicted_correct": 5, "predicted_experts": 7,
             "bytes_read": 2_000_000, "stall_ms": 4.0},
            {"hits": 0, "misses": 0, "bytes_read": 8_000_000, "stall_ms": 1.0},
        ],
    }  # fmt: skip
    s = MoeTracer(None, stream=None).summary(stats)
    l0, l1, t = s["layers"][0], s["layers"][1], s["total"]
    assert l0["hit_rate"] == 0.75 and l0["recall_at_k"] == 5 / 8 and l0["precision"] == 5 / 7
    assert l1["hit_rate"] is None and l1["recall_at_k"] is None and l1["precision"] is None
    assert t["hit_rate"] == 0.75 and t["stall_ms"] == 5.0 and t["io_bytes"] == 10_000_000
    assert t["io_gbps"] == pytest.approx(0.5)  # 10 MB in 20 ms
    assert t["compute_ms"] == 95.0 and t["overlap"] == pytest.approx(0.75) and t["predict_overhead"] == 0.05


def test_missing_keys_count_as_zero_and_ratios_become_none():
    # Today's engine: no predictor counters, no global times, no top_k.
    rng = np.random.default_rng(5)
    stats = random_stats(rng, 4, 2, with_new_keys=False)
    s = MoeTracer(None, stream=None).summary(stats, [])
    t = s["total"]
    assert s["top_k"] is None
    for key in ("predictions", "predicted_correct", "predicted_experts", "hints_dropped", "prefetch_skipped"):
        assert t[key] == 0
    assert t["recall_at_k"] is None and t["precision"] is None
    assert t["io_gbps"] is None and t["overlap"] is None and t["compute_ms"] is None
    assert t["predict_overhead"] is None and t["io_busy_source"] == "none"
    assert t["hit_rate"] == pytest.approx(
        sum(lay["hits"] for lay in stats["layers"]) / sum(lay["accesses"] for lay in stats["layers"])
    )
    # top_k from the constructor when the stats lack it.
    stats["layers"][0].update({"predictions": 3, "predicted_correct": 4})
    s = MoeTracer(None, stream=None, top_k=2).summary(stats)
    assert s["layers"][0]["recall_at_k"] == 4 / 6
    # An empty (all resident) session.
    s = MoeTracer(None, stream=None).summary({"layers": []})
    assert s["layers"] == [] and s["total"]["hit_rate"] is None


def test_io_busy_falls_back_to_the_union_of_reader_spans():
    rng = np.random.default_rng(9)
    events, grid = [], np.zeros(5000, dtype=bool)
    for i in range(60):
        start, dur = int(rng.integers(0, 4000)), int(rng.integers(0, 400))
        track = "reader" if i % 3 else "reader #2"
        events.append(
            {"track": track, "name": f"L{i % 4} E{i}", "start_us": float(start), "dur_us": float(dur)}
        )
        grid[start : start + dur] = True
    events.append({"track": "compute", "name": "layer 0", "start_us": 0.0, "dur_us": 4900.0})
    stats = {"layers": [{"hits": 1, "misses": 1, "stall_ms": 0.5, "bytes_read": 1000}]}
    t = MoeTracer(None, stream=None).summary(stats, events)["total"]
    assert t["io_busy_source"] == "timeline"
    assert t["io_busy_ms"] == pytest.approx(grid.sum() / 1000)
    assert t["overlap"] == pytest.approx(1 - 0.5 / (grid.sum() / 1000))
    # The engine's own figure wins over the timeline.
    stats["io_busy_ms"] = 2.0
    t = MoeTracer(None, stream=None).summary(stats, events)["total"]
    assert t["io_busy_source"] == "expert_stats" and t["io_busy_ms"] == 2.0


def test_requests():
    tracer = MoeTracer(None, stream=None)
    reqs = [
        {"n_prompt": 10, "n_generated": 5, "prefill_s": 0.5, "decode_s": 0.4, "ttft_s": 0.6, "tpot_s": 0.1,
         "prefill_tok_s": 20.0, "decode_tok_s": 10.0},
        {"n_prompt": 30, "n_generated": 1, "prefill_s": 1.5, "decode_s": 0.0, "ttft_s": 1.5, "tpot_s": 0.0,
         "prefill_tok_s": 20.0, "decode_tok_s": 0.0},
        {"n_prompt": 4, "n_generated": 3, "prefill_s": 0.2, "decode_s": 0.4, "ttft_s": 0.3, "tpot_s": 0.2,
         "prefill_tok_s": 20.0, "decode_tok_s": 5.0},
    ]  # fmt: skip
    for r in reqs:
        tracer.add_request(r)
    tracer.add_request({})  # a request without stats: zeros, no crash
    s = tracer.summary({"layers": []})
    assert [r["ttft_ms"] for r in s["requests"]] == pytest.approx([600, 1500, 300, 0])
    assert [r["tpot_ms"] for r in s["requests"]] == pytest.approx([100, 0, 200, 0])
    assert s["requests"][2]["decode_tok_s"] == 5.0 and s["requests"][0]["prefill_tok_s"] == 20.0
    rt = s["requests_total"]
    assert rt["requests"] == 4
    assert rt["ttft_ms_mean"] == pytest.approx((600 + 1500 + 300 + 0) / 4)
    assert rt["tpot_ms"] == pytest.approx(800 / 6)  # 0.8 s over 4 + 0 + 2 decode steps
    assert rt["prefill_tok_s"] == pytest.approx(44 / 2.2)
    assert rt["decode_tok_s"] == pytest.approx(6 / 0.8)


def check_trace_document(doc):
    names = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in doc["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    by_tid = {}
    for e in doc["traceEvents"]:
        if e["ph"] != "X":
            continue
        assert (e["pid"], e["tid"]) in names and e["dur"] >= 0
        by_tid.setdefault(e["tid"], []).append(e)
    for evs in by_tid.values():  # spans on one lane nest
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in evs:
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            assert not stack or e["ts"] + e["dur"] <= stack[-1]
            stack.append(e["ts"] + e["dur"])
    return names


def test_finish_writes_json_timeline_and_table(tmp_path):
    rng = np.random.default_rng(11)
    stats = random_stats(rng, 3, 4)
    events = []
    for il in range(3):
        events.append({"track": "compute", "name": f"layer {il}", "start_us": il * 100.0, "dur_us": 90.0})
        events.append(
            {"track": "stall", "name": f"wait L{il} E1", "start_us": il * 100.0 + 10, "dur_us": 5.0}
        )
        for e in range(3):  # overlapping reads: more than one reader lane
            events.append(
                {"track": "reader", "name": f"L{il} E{e}", "start_us": il * 100.0 + e * 7, "dur_us": 40.0}
            )
    out = io.StringIO()
    tracer = MoeTracer(str(tmp_path / "trace"), stream=out)
    tracer.add_request({"n_prompt": 3, "n_generated": 2, "ttft_s": 0.01, "tpot_s": 0.02, "decode_s": 0.02})
    doc = tracer.finish(stats, events)
    on_disk = json.loads((tmp_path / "trace" / "moe_trace.json").read_text())
    assert on_disk == json.loads(json.dumps(doc))
    assert on_disk["total"]["overlap"] == pytest.approx(
        1 - sum(lay["stall_ms"] for lay in stats["layers"]) / stats["io_busy_ms"]
    )
    tl = json.loads((tmp_path / "trace" / "moe_trace_timeline.json").read_text())
    lanes = set(check_trace_document(tl).values())
    assert {"compute", "stall", "reader", "reader #2"} <= lanes
    assert sum(1 for e in tl["traceEvents"] if e["ph"] == "X") == len(events) == doc["timeline"]["n_events"]
    text = out.getvalue()
    assert text == format_table(doc)
    table = text.splitlines()
    assert table[2].split()[0] == "0" and table[4].split()[0] == "2" and table[5].split()[0] == "total"
    assert f"{doc['total']['hit_rate']:.3f}" in table[5] and "overlap" in table[6]
    assert "TTFT" in text and "moe_trace_timeline.json" in text


def test_finish_without_out_dir_or_events_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    doc = MoeTracer(None, stream=out).finish({"layers": [{"hits": 2, "misses": 2}]}, [])
    assert "files" not in doc and list(tmp_path.iterdir()) == []
    assert "total" in out.getvalue()
    # With an out_dir but no events the timeline is still a valid (empty) trace.
    MoeTracer(str(tmp_path / "o"), stream=None).finish({"layers": []}, [])
    tl = json.loads((tmp_path / "o" / "moe_trace_timeline.json").read_text())
    assert [e["ph"] for e in tl["traceEvents"]] == ["M"]


def test_device_stream_tracks_sit_beside_compute_and_spread_overlapping_copies():
    # A device session's spans: layers on the compute stream, expert fills on the copy stream (several in
    # flight, crossing each other), stalls; whatever order they arrive in, the lanes are ordered compute,
    # compute stream, copy stream (crossing fills on extra lanes), then stall.
    from sharpi.timeline import chrome_trace

    events = [{"track": "stall", "name": "wait", "start_us": 5.0, "dur_us": 1.0}]
    events += [{"track": "copy stream", "name": f"fill {i}", "start_us": 3.0 * i, "dur_us": 10.0} for i in range(3)]
    events += [
        {"track": "compute stream", "name": f"layer {il}", "start_us": 20.0 * il, "dur_us": 15.0} for il in range(2)
    ]
    events.append({"track": "compute", "name": "layer 0", "start_us": 0.0, "dur_us": 40.0})
    doc = chrome_trace(events)
    names = check_trace_document(doc)
    sort_index = {
        (e["pid"], e["tid"]): e["args"]["sort_index"]
        for e in doc["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_sort_index"
    }
    lanes = [names[key] for key in sorted(names, key=lambda key: sort_index[key])]
    assert lanes == ["compute", "compute stream", "copy stream", "copy stream #2", "copy stream #3", "stall"]
