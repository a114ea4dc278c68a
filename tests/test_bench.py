"""`sharpi bench` and its parts: Belady / LRU policies, the Chrome trace writer, the memory cap and a
smoke run of the whole benchmark on tiny models.

Oracles: an exhaustive search over every demand-paging schedule (which experts to keep after each
step) for Belady; textbook page-fault counts for both policies; a trace-event nesting check written
here for the trace writer; the `gguf` package's reading of the file for the bytes the engine reads;
the recorded trace itself for trace replay.
"""

from __future__ import annotations

import functools
import itertools
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from shared_data import TRACES_DIR
from sharpi.belady import belady, lru, steps_from_routing
from sharpi.timeline import chrome_trace, write_chrome_trace
from subprocess_env import child_env

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ policies


def brute_force_min_misses(steps, capacity, warm=()):
    """Fewest misses over every demand schedule: after each step keep the step's experts plus any
    subset of the other residents that fits (voluntary evictions allowed); start from any subset of
    `warm` that fits."""
    steps = [frozenset(s) for s in steps]

    @functools.cache
    def best(i, cache):
        if i == len(steps):
            return 0
        need = steps[i]
        misses = len(need - cache)
        others = sorted(cache - need)
        room = capacity - len(need)
        options = []
        for r in range(min(room, len(others)) + 1):
            for keep in itertools.combinations(others, r):
                options.append(best(i + 1, need | frozenset(keep)))
        return misses + min(options)

    warm = sorted(set(warm))
    starts = [
        frozenset(c) for r in range(min(capacity, len(warm)) + 1) for c in itertools.combinations(warm, r)
    ]
    return min(best(0, s) for s in starts)


def random_steps(rng, n_steps, universe, max_set):
    return [frozenset(rng.sample(range(universe), rng.randint(1, max_set))) for _ in range(n_steps)]


def test_belady_matches_exhaustive_search_on_random_sequences():
    rng = random.Random(1234)
    for case in range(250):
        universe = rng.randint(2, 6)
        max_set = rng.randint(1, min(3, universe))
        capacity = rng.randint(max_set, min(universe, max_set + 2))
        steps = random_steps(rng, rng.randint(1, 9), universe, max_set)
        got = belady(steps, capacity).misses
        want = brute_force_min_misses(steps, capacity)
        assert got == want, f"case {case}: steps {steps}, capacity {capacity}: belady {got}, optimum {want}"


def test_belady_warm_start_matches_exhaustive_search():
    rng = random.Random(99)
    for case in range(150):
        universe = rng.randint(3, 6)
        max_set = rng.randint(1, 2)
        capacity = rng.randint(max_set, universe)
        steps = random_steps(rng, rng.randint(1, 7), universe, max_set)
        warm = rng.sample(range(universe), rng.randint(0, universe))
        got = belady(steps, capacity, warm=warm).misses
        want = brute_force_min_misses(steps, capacity, warm)
        assert got == want, f"case {case}: steps {steps}, cap {capacity}, warm {warm}: {got} vs {want}"


def test_textbook_reference_string():
    # Silberschatz et al., Operating System Concepts: this string with 3 frames takes 9 faults with
    # the optimal algorithm and 12 with LRU.
    refs = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]
    steps = [{r} for r in refs]
    assert belady(steps, 3).misses == 9
    assert lru(steps, 3).misses == 12
    assert brute_force_min_misses(steps, 3) == 9


def test_experts_of_the_current_step_are_never_evicted():
    # Capacity 2: at step {a, c} the residents are a (never used again) and b (used next step).
    # Plain farthest-next-use would evict a, which this very step needs; the pin rule evicts b.
    a, b, c = "a", "b", "c"
    steps = [{a}, {b}, {a, c}, {b}]
    r = belady(steps, 2)
    assert r.misses_per_step == [1, 1, 1, 1]
    assert r.misses == 4 == brute_force_min_misses(steps, 2)
    # Hand-worked: {a,b} then {c}: evict b (next use later than a); a hits; b misses again.
    r = belady([{a, b}, {c}, {a}, {b}], 2)
    assert r.misses_per_step == [2, 1, 0, 1]


def test_warm_start_keeps_the_earliest_needed():
    # Warm candidates a, b, c, capacity 2: the best start holds the two needed first (c, a).
    r = belady([{"c"}, {"a"}, {"b"}], 2, warm={"a", "b", "c"})
    assert r.misses_per_step == [0, 0, 1]
    # Candidates never used cost nothing and never displace used ones.
    r = belady([{"x"}], 1, warm={"y", "z"})
    assert r.misses == 1


def test_belady_never_worse_than_lru_on_larger_sequences():
    rng = random.Random(7)
    for _ in range(40):
        universe = rng.randint(8, 64)
        max_set = rng.randint(1, 6)
        capacity = rng.randint(max_set, universe)
        warm = random_steps(rng, rng.randint(0, 20), universe, max_set)
        steps = random_steps(rng, rng.randint(10, 200), universe, max_set)
        opt = belady(steps, capacity, warm=set().union(*warm) if warm else ())
        ref = lru(warm + steps, capacity, count_from=len(warm))
        assert opt.accesses == ref.accesses == sum(len(s) for s in steps)
        assert opt.misses <= ref.misses
        assert belady(steps, capacity).misses <= lru(steps, capacity).misses


def test_lru_against_a_plain_list_simulation():
    def plain_lru(steps, capacity):
        order, misses = [], 0  # most recent last
        for need in steps:
            for key in sorted(need):
                if key in order:
                    order.remove(key)
                else:
                    misses += 1
                order.append(key)
            while len(order) > capacity:
                victim = next(k for k in order if k not in need)
                order.remove(victim)
        return misses

    rng = random.Random(5)
    for _ in range(200):
        universe = rng.randint(2, 12)
        max_set = rng.randint(1, min(3, universe))
        capacity = rng.randint(max_set, universe)
        steps = random_steps(rng, rng.randint(1, 40), universe, max_set)
        assert lru(steps, capacity).misses == plain_lru(steps, capacity)


def test_steps_larger_than_the_cache_are_rejected():
    with pytest.raises(ValueError, match="step 1 needs 3 experts"):
        belady([{1}, {1, 2, 3}], 2)
    with pytest.raises(ValueError, match="cache holds only 2"):
        lru([{1, 2, 3}], 2)


def test_steps_from_routing_keys_and_order():
    routing = [[[3, 1], [0, 2]], [[1, -1], [2, 2]]]  # token, layer, k
    assert steps_from_routing(routing, n_expert=4) == [
        frozenset({3, 1}),
        frozenset({4, 6}),
        frozenset({1}),
        frozenset({6}),
    ]


# ------------------------------------------------------------------------------------------ trace writer


def check_trace_document(doc, n_spans):
    """What Perfetto / chrome://tracing need: a traceEvents list; X events with numeric ts/dur and
    pid/tid; a thread_name for every tid used; spans on one tid properly nested."""
    assert isinstance(doc["traceEvents"], list)
    names = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in doc["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == n_spans
    by_tid = {}
    for e in spans:
        assert isinstance(e["name"], str) and e["name"]
        assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)) and e["dur"] >= 0
        assert (e["pid"], e["tid"]) in names, f"tid {e['tid']} has no thread_name"
        by_tid.setdefault(e["tid"], []).append(e)
    for tid, evs in by_tid.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in evs:
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            assert not stack or e["ts"] + e["dur"] <= stack[-1], f"tid {tid}: {e} crosses an open span"
            stack.append(e["ts"] + e["dur"])
    return names, by_tid


def test_chrome_trace_lanes_and_fields(tmp_path):
    rng = np.random.default_rng(3)
    events = []
    t = 0.0
    for il in range(6):  # a layer span containing its attention span, stalls inside
        events.append({"track": "compute", "name": f"layer {il}", "start_us": t, "dur_us": 100.0})
        events.append({"track": "compute", "name": f"attention {il}", "start_us": t + 1, "dur_us": 30.0})
        events.append({"track": "stall", "name": f"wait L{il}", "start_us": t + 40, "dur_us": 20.0})
        t += 100.0
    for i in range(30):  # overlapping reads, as a reader with several in flight produces
        start = float(rng.uniform(0, 600))
        events.append(
            {
                "track": "reader",
                "name": f"L{i % 6} E{i}",
                "start_us": start,
                "dur_us": float(rng.uniform(5, 80)),
            }
        )

    summary = write_chrome_trace(events, tmp_path / "sub" / "t.json")
    doc = json.loads((tmp_path / "sub" / "t.json").read_text())
    names, by_tid = check_trace_document(doc, len(events))
    assert summary["n_events"] == len(events)
    lanes = list(names.values())
    assert lanes[0] == "compute" and lanes[1] == "stall" and "reader" in lanes
    assert any(n.startswith("reader #") for n in lanes), "overlapping reads need extra lanes"
    compute_tids = [tid for (_, tid), n in names.items() if n == "compute"]
    assert len(compute_tids) == 1 and len(by_tid[compute_tids[0]]) == 12, "nested spans share one lane"
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    assert meta and meta[0]["args"]["name"]


def test_chrome_trace_rejects_malformed_events():
    with pytest.raises(ValueError, match="event 1"):
        chrome_trace([{"track": "compute", "name": "x", "start_us": 0, "dur_us": 1}, {"track": "compute"}])
    with pytest.raises(ValueError, match="negative duration"):
        chrome_trace([{"track": "reader", "name": "x", "start_us": 5, "dur_us": -1}])
    assert chrome_trace([])["traceEvents"][0]["name"] == "process_name"


# ------------------------------------------------------------------------------------------ memory cap


def test_memory_cap_kills_a_process_over_its_limit():
    from sharpi.bench.isolation import MemoryCap

    hog = [sys.executable, "-c", "x = b'1' * (256 << 20); print(len(x))"]
    with MemoryCap(64 << 20) as cap:
        if not cap.applied:
            pytest.skip(f"memory cap unavailable here: {cap.reason}")
        proc = subprocess.run(cap.command(hog), check=False, capture_output=True)
        cap.read_counters()
    assert proc.returncode in (-9, 137), proc
    assert cap.report()["oom_kills"] >= 1
    assert not Path(cap.report()["group"]).exists(), "the group is removed afterwards"
    with MemoryCap(1 << 30) as cap:
        proc = subprocess.run(cap.command(hog), check=False, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == str(256 << 20)


# ------------------------------------------------------------------------------------------ smoke run


def expert_bytes_by_gguf(path):
    """Bytes of one expert per MoE layer, read with the gguf package (independent of sharpi's reader);
    layers without experts (deepseek2's leading dense layer) are left out, as the bench counts layers."""
    import gguf

    r = gguf.GGUFReader(path)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    n_layer = int(r.fields[f"{arch}.block_count"].parts[-1][0])
    n_expert = int(r.fields[f"{arch}.expert_count"].parts[-1][0])
    sizes = {t.name: int(t.n_bytes) for t in r.tensors}
    return [
        sum(sizes[f"blk.{il}.ffn_{p}_exps.weight"] for p in ("gate", "up", "down")) // n_expert
        for il in range(n_layer)
        if f"blk.{il}.ffn_gate_exps.weight" in sizes
    ]


RUN_FIELDS_EXPECTED = {
    "share", "n_slots", "budget_bytes", "cap", "cache_drop", "reader", "tokens", "warmup_tokens",
    "decode_s", "tpot_ms", "tpot_p50_ms", "decode_tok_s", "cpu_ms_per_token", "accesses", "hits", "misses", "evictions",
    "hit_rate", "bytes_read", "bytes_per_token", "stall_ms", "stall_fraction", "io_gbps_wall",
    "io_gbps_stall", "peak_rss_bytes", "major_faults_per_token", "belady_misses", "belady_bytes", "belady_hit_rate", "lru_misses",
    "lru_hit_rate", "lower_bound_ms_per_token", "ratio_tpot_to_lower_bound",
    "ratio_tpot_to_lower_bound_plus_resident", "goal_met", "verdict", "engine_misses_at_least_belady",
    "output_matches_resident", "layers", "predictor", "lookahead", "prefetch_sizing", "n_staging", "recall_at_k",
    "precision",
    "prefetch_issued", "prefetch_used", "prefetch_timely", "prefetch_late", "prefetch_wasted_bytes",
    "prefetch_skipped", "hints_dropped", "predict_ms", "predict_overhead", "overlap",
}  # fmt: skip


def test_run_fields_are_the_documented_ones():
    from sharpi.bench.report import RUN_FIELDS

    assert set(RUN_FIELDS) == RUN_FIELDS_EXPECTED and len(RUN_FIELDS) == len(RUN_FIELDS_EXPECTED)


SHARED_TRACE = TRACES_DIR / "deepseek_v2_lite_train.npz"  # replayed by the bench when present


def run_bench(out, models, *extra):
    """`sharpi bench --quick` in a subprocess; returns (bench.json, stdout)."""
    # The child imports the same sharpi as this process: the installed package in CI, a developer
    # build under python/ when PYTHONPATH points there.
    env = child_env()
    cmd = [
        sys.executable,
        "-m",
        "sharpi.cli",
        "bench",
        "--quick",
        "--out",
        str(out),
        "--model-dir",
        str(models),
    ]
    proc = subprocess.run(
        cmd + list(extra), check=False, capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((out / "bench.json").read_text())
    assert (out / "bench.txt").read_text() in proc.stdout
    return doc, proc.stdout


def independent_eval_start(seq_start) -> int:
    """First row of the evaluation split, as shared/traces/README.md states it: the first 70% of
    the sequences train, the rest evaluate."""
    n_train = int(len(seq_start) * 7 // 10)
    return int(seq_start[n_train])


@pytest.mark.shared_data  # replays ../shared's trace when present, and must pass without it
def test_bench_quick_smoke(tmp_path):
    out, models = tmp_path / "out", tmp_path / "models"
    doc, _ = run_bench(out, models)

    for key in ("command", "machine", "options", "goal_ratio", "workloads", "timeline", "wall_s"):
        assert key in doc, key
    ran = [w for w in doc["workloads"] if "skipped" not in w]
    assert ran and ran[0]["name"] == "random"
    for w in ran:
        m = w["model"]
        assert m["expert_bytes_per_layer"] == expert_bytes_by_gguf(m["path"])
        assert w["sequential_read"]["gbps"] > 0 and w["resident"]["tpot_ms"] > 0
        total = m["n_layer"] * m["n_expert"]
        assert [r["share"] for r in w["runs"]] == [0.25, 0.5, 1.0]
        for r in w["runs"]:
            assert RUN_FIELDS_EXPECTED <= set(r), RUN_FIELDS_EXPECTED - set(r)
            assert r["n_slots"] == min(total, max(m["n_expert_used"], round(r["share"] * total)))
            assert r["budget_bytes"] == m["fixed_bytes"] + r["n_slots"] * m["slot_bytes"]
            assert r["accesses"] == r["tokens"] * m["n_layer"] * m["n_expert_used"] == r["hits"] + r["misses"]
            # Bytes the engine read: its misses, each one expert of its layer (sizes from the gguf package).
            per_layer = expert_bytes_by_gguf(m["path"])
            assert r["bytes_read"] == sum(lay["misses"] * per_layer[il] for il, lay in enumerate(r["layers"]))
            assert r["predictor"] == "none" and r["n_staging"] == 0 and r["prefetch_issued"] == 0
            assert r["belady_misses"] <= r["misses"] and r["belady_misses"] <= r["lru_misses"]
            assert r["engine_misses_at_least_belady"] is True
            assert r["output_matches_resident"] is True, "streamed logits must equal the resident engine's"
            assert 0 <= r["hit_rate"] <= 1 and 0 <= r["stall_fraction"] <= 1
            assert r["cap"]["applied"] in (True, False)
            if r["cap"]["applied"]:
                assert r["cap"]["limit_bytes"] >= r["budget_bytes"]
            else:
                assert r["cap"]["reason"]
            assert isinstance(r["verdict"], str) and r["verdict"]
        # A cache holding every expert misses only on first use: each expert at most once.
        assert w["runs"][-1]["misses"] <= total

    trace = next(w for w in doc["workloads"] if w["name"] == "trace")
    if "skipped" not in trace:
        # The replayed routing is the trace's, rows warm-up.. of its first n_layer layers.
        work = out / "work"
        res = json.loads((work / "trace-0.25.result.json").read_text())
        rows = np.load(work / "trace-replayed-rows.npy")
        warm = len(res["warm_routing"])
        for t, per_layer in enumerate(res["routing"]):
            for il, ids in enumerate(per_layer):
                want = rows[warm + t, il]
                if (want >= 0).all():
                    assert sorted(ids) == sorted(want.tolist())
        with np.load(SHARED_TRACE) as z:
            n_layer = trace["model"]["n_layer"]
            start = independent_eval_start(z["seq_start"])
            assert trace["trace_rows_start"] == start, "the replayed rows are the evaluation split's"
            np.testing.assert_array_equal(rows, z["experts"][start : start + len(rows), :n_layer])

    tl = doc["timeline"]
    if tl.get("path"):
        tdoc = json.loads(Path(tl["path"]).read_text())
        names, _ = check_trace_document(tdoc, tl["n_events"])
        assert "compute" in names.values() and "reader" in names.values()
    else:
        assert tl["note"], "without a timeline the report says why"
    # matplotlib comes with the test extra: one PNG per workload that ran (tests/test_bench_plots.py
    # checks what they draw).
    assert doc["plots"] == [str(out / f"bench-{w['name']}.png") for w in ran]
    assert all(Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in doc["plots"])


# ------------------------------------------------------------------------------------------ predictor axis


def test_predictor_options():
    import argparse

    from sharpi.bench import arguments as bench

    assert bench._predictor_list("cooc,none,prev_token,cooc") == ["none", "cooc", "prev_token"]
    assert bench._predictor_list("trajectory") == ["none", "trajectory"]
    for bad in ("", "cooc,oracle", ","):
        with pytest.raises(argparse.ArgumentTypeError, match="--predictors"):
            bench._predictor_list(bad)
    assert bench._lookahead("3") == 3
    for bad in ("0", "4", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="--lookahead"):
            bench._lookahead(bad)
    here = str(Path(__file__))
    assert bench.parse_predictor_file(f"cooc={here}") == (None, "cooc", here)
    assert bench.parse_predictor_file(f"trace:trajectory={here}") == ("trace", "trajectory", here)
    for bad in (f"next_gate={here}", f"cooc{here}", "cooc=", f"gpu:cooc={here}"):
        with pytest.raises(argparse.ArgumentTypeError, match="--predictor-file"):
            bench.parse_predictor_file(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="is not a file"):
        bench.parse_predictor_file("learned=/nonexistent/x.gguf")


def random_trace(rng, n_seq, n_layer, n_expert, k):
    lengths = rng.integers(1, 40, size=n_seq)
    seq_start = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    n_tok = int(lengths.sum())
    experts = np.stack(
        [
            np.stack([rng.choice(n_expert, size=k, replace=False) for _ in range(n_layer)])
            for _ in range(n_tok)
        ]
    ).astype(np.int16)
    return {
        "experts": experts,
        "seq_start": seq_start,
        "num_experts": np.int32(n_expert),
        "top_k": np.int32(k),
        "moe_layer_ids": np.arange(n_layer, dtype=np.int16) + 1,
        "prompt_id": np.arange(n_seq, dtype=np.int32) + 100,
    }


@pytest.mark.parametrize("n_seq", [2, 3, 10, 37])
def test_eval_split_and_train_trace(tmp_path, n_seq):
    from sharpi.bench.workloads import eval_split, write_train_trace

    rng = np.random.default_rng(n_seq)
    t = random_trace(rng, n_seq, n_layer=6, n_expert=16, k=2)
    src = tmp_path / "src.npz"
    np.savez(src, **t)
    n_train, start = eval_split(t["seq_start"], t["experts"].shape[0])
    assert n_train == max(1, min(n_seq - 1, n_seq * 7 // 10)) and start == t["seq_start"][n_train]
    for cap in (None, 1, 50):
        out = tmp_path / f"train-{cap}.npz"
        info = write_train_trace(src, out, n_layer=4, max_tokens=cap)
        with np.load(out) as z:
            n = z["experts"].shape[0]
            assert n == info["tokens"] and len(z["seq_start"]) == info["sequences"]
            assert n <= start, "no evaluation row may reach the training file"
            np.testing.assert_array_equal(z["experts"], t["experts"][:n, :4])
            np.testing.assert_array_equal(z["seq_start"], t["seq_start"][: info["sequences"]])
            np.testing.assert_array_equal(z["moe_layer_ids"], t["moe_layer_ids"][:4])
            np.testing.assert_array_equal(z["prompt_id"], t["prompt_id"][: info["sequences"]])
            # Whole sequences only: the file ends where a sequence ends.
            ends = list(t["seq_start"][1:]) + [t["experts"].shape[0]]
            assert n == ends[info["sequences"] - 1]
            if cap is None:
                assert n == start
            else:
                assert info["sequences"] == min(n_train, max(2, sum(1 for e in ends[:n_train] if e <= cap)))


def test_eval_split_of_the_shared_trace(shared_traces):
    from sharpi.bench.workloads import eval_split

    with np.load(shared_traces / SHARED_TRACE.name) as z:
        n_train, start = eval_split(z["seq_start"], z["experts"].shape[0])
        assert start == independent_eval_start(z["seq_start"]) and n_train == len(z["seq_start"]) * 7 // 10


def test_compare_predictors_picks_the_least_stall():
    from sharpi.bench.report import compare_predictors, round_summary

    def run(share, pred, stall, tpot, tokens=10):
        return {"share": share, "predictor": pred, "stall_ms": stall, "tokens": tokens, "tpot_ms": tpot}

    runs = [
        run(0.25, "none", 200.0, 50.0),
        run(0.25, "prev_token", 150.0, 45.0),
        run(0.25, "cooc", 50.0, 30.0, tokens=5),  # 10 ms/token: the best
        {"share": 0.25, "predictor": "trajectory", "skipped": "no"},
        run(0.5, "none", 0.0, 20.0),
        run(0.5, "cooc", 0.0, 21.0),
        run(1.0, "none", 5.0, 10.0),  # no predictor ran at this share: no comparison
    ]
    got = compare_predictors(round_summary(runs))
    assert [c["share"] for c in got] == [0.25, 0.5]
    c = got[0]
    assert (
        c["best"] == "cooc" and c["stall_ms_per_token_none"] == 20.0 and c["stall_ms_per_token_best"] == 10.0
    )
    assert c["stall_reduction"] == pytest.approx(0.5) and c["tpot_speedup"] == pytest.approx(50 / 30)
    assert got[1]["stall_reduction"] is None and got[1]["best"] == "cooc"


def test_rotated_order_puts_every_run_in_every_position():
    from sharpi.bench.runner import rotated

    plan = [("none", None), ("cooc", "c.gguf"), ("trajectory", "t.gguf"), ("depthtime", "d.gguf")]
    orders = [rotated(plan, rnd) for rnd in range(2 * len(plan))]
    for order in orders:
        assert sorted(order) == sorted(plan), "a round runs every configuration exactly once"
    for pos in range(len(plan)):
        assert {order[pos][0] for order in orders[: len(plan)]} == {p for p, _ in plan}
    assert orders[0] == plan and orders[len(plan)] == plan and rotated([], 3) == []


def test_round_summary_cuts_stall_against_the_same_rounds_none():
    from sharpi.bench.report import compare_predictors, round_summary

    def run(rnd, pred, stall, tpot, tokens=10, share=0.25):
        return {"share": share, "predictor": pred, "round": rnd, "stall_ms": stall, "tokens": tokens,
                "tpot_ms": tpot, "hit_rate": 0.5, "bytes_per_token": 100.0,
                "prefetch_wasted_bytes_per_token": 0.0 if pred == "none" else 10.0}  # fmt: skip

    # Round 1's none is slow: pooled medians and same-round cuts disagree, which is the point.
    none = {0: 1000.0, 1: 3000.0, 2: 1200.0}
    a = {0: 600.0, 1: 1500.0, 2: 900.0}
    b = {0: 500.0, 1: 2400.0, 2: 700.0}
    runs = [run(r, "none", none[r], 100.0 + r) for r in range(3)]
    runs += [run(r, "a", a[r], 80.0 + r) for r in range(3)]
    runs += [run(r, "b", b[r], 70.0 + r) for r in range(3)]
    runs.append({"share": 0.25, "predictor": "b", "round": 3, "error": "killed"})  # not a round of b
    runs.append(run(3, "a", 10.0, 1.0))  # a round whose none never finished: no cut, still a run
    got = {m["predictor"]: m for m in round_summary(runs)}
    assert list(got) == ["none", "a", "b"]
    assert got["none"]["rounds"] == 3 and got["a"]["rounds"] == 4 and got["b"]["rounds"] == 3
    assert got["none"]["stall_ms_per_token"] == 120.0 and got["none"]["stall_cut"] is None
    assert got["a"]["stall_ms_per_token"] == pytest.approx(np.median([60, 150, 90, 1]))
    assert got["b"]["tpot_ms"] == 71.0 and got["b"]["wasted_fraction"] == pytest.approx(0.1)
    cuts_a = [1 - 600 / 1000, 1 - 1500 / 3000, 1 - 900 / 1200]
    cuts_b = [1 - 500 / 1000, 1 - 2400 / 3000, 1 - 700 / 1200]
    np.testing.assert_allclose(got["a"]["stall_cuts"], cuts_a)
    np.testing.assert_allclose(got["b"]["stall_cuts"], cuts_b)
    assert got["a"]["stall_cut"] == pytest.approx(0.4) and got["b"]["stall_cut"] == pytest.approx(5 / 12)
    (c,) = compare_predictors(round_summary(runs))
    # The best by median stall per token: a (median of 60, 90, 150, 1 = 75) against b (70).
    assert c["best"] == "b" and c["rounds"] == 3
    assert c["stall_ms_per_token_none"] == 120.0 and c["stall_ms_per_token_best"] == 70.0
    assert c["stall_reduction"] == pytest.approx(np.median(cuts_b))
    assert c["tpot_speedup"] == pytest.approx(101.0 / 71.0)


@pytest.mark.shared_data  # replays ../shared's trace when present, and must pass without it
def test_bench_predictor_axis_quick(tmp_path):

    out, models = tmp_path / "out", tmp_path / "models"
    doc, stdout = run_bench(
        out, models, "--predictors", "none,prev_token,cooc,next_gate", "--lookahead", "1", "--rounds", "2"
    )
    assert "medians over 2 rounds" in stdout
    assert "route unlike trained ones" in stdout
    ran = [w for w in doc["workloads"] if "skipped" not in w]
    assert ran
    for w in ran:
        m = w["model"]
        pw = w["predictors"]
        assert pw["lookahead"] == 1 and pw["runs"][0] == "none"
        assert sorted({r["share"] for r in w["runs"]}) == [0.25, 0.5]
        if w["name"] == "trace":
            assert "hidden states" in pw["skipped"]["next_gate"]
        assert "cooc" in pw["runs"], pw["skipped"]
        done = [r for r in w["runs"] if "tpot_ms" in r]
        assert {r["predictor"] for r in done} >= {"none", "prev_token"}
        for r in done:
            assert RUN_FIELDS_EXPECTED <= set(r), RUN_FIELDS_EXPECTED - set(r)
            assert r["output_matches_resident"] is True, f"{r['predictor']}: prediction must be lossless"
            # Staging slots come out of the same budget as the cache.
            assert r["budget_bytes"] == m["fixed_bytes"] + (r["n_slots"] + r["n_staging"]) * m["slot_bytes"]
            assert r["accesses"] == r["tokens"] * m["n_layer"] * m["n_expert_used"] == r["hits"] + r["misses"]
            assert r["prefetch_used"] <= r["prefetch_issued"]
            assert r["prefetch_timely"] + r["prefetch_late"] == r["prefetch_used"]
            assert r["recall_at_k"] is None or 0 <= r["recall_at_k"] <= 1
            if r["predictor"] == "none":
                assert r["n_staging"] == 0 and r["prefetch_issued"] == 0
            else:
                assert r["n_staging"] >= m["n_expert_used"] and r["lookahead"] == 1
        # A settling run of the first configuration went before the measured ones and is not among them.
        assert w["settle_run"]["ok"] is True and w["settle_run"]["predictor"] == "none"
        assert (out / "work" / f"{w['name']}-settle.result.json").is_file()
        assert len(w["runs"]) == 2 * 2 * len(pw["runs"])  # rounds x shares x predictors
        # Two rounds, each running every configuration of a share once, round 1 in round 0's order
        # rotated by one (none no longer first).
        for share in (0.25, 0.5):
            order = [[r["predictor"] for r in w["runs"] if r["share"] == share and r["round"] == rnd]
                     for rnd in (0, 1)]  # fmt: skip
            assert order[0] == pw["runs"] and order[1] == pw["runs"][1:] + pw["runs"][:1]
        # The comparison, recomputed from the runs: medians over rounds, cuts within a round.
        for c in w["predictor_comparison"]:
            same = [r for r in done if r["share"] == c["share"]]
            stall = {(r["predictor"], r["round"]): r["stall_ms"] / r["tokens"] for r in same}
            per_token = {
                p: np.median([v for (q, _), v in stall.items() if q == p]) for p, _ in stall if p != "none"
            }
            assert c["best"] == min(per_token, key=per_token.get) and c["rounds"] == 2
            cuts = [1 - stall[(c["best"], rnd)] / stall[("none", rnd)] for rnd in (0, 1)
                    if stall.get(("none", rnd), 0) > 0 and (c["best"], rnd) in stall]  # fmt: skip
            if cuts:
                assert c["stall_reduction"] == pytest.approx(np.median(cuts))
        assert len(w["predictor_comparison"]) == 2
        cooc = [r for r in done if r["predictor"] == "cooc"]
        if w["name"] == "trace" and cooc:
            # Trained on the train split only: the training file ends before the replayed rows.
            with np.load(out / "work" / "trace-train-trace.npz") as tz, np.load(SHARED_TRACE) as z:
                n = tz["experts"].shape[0]
                assert n <= w["trace_rows_start"] == independent_eval_start(z["seq_start"])
                np.testing.assert_array_equal(tz["experts"], z["experts"][:n, : m["n_layer"]])
            assert all(Path(r["predictor_file"]).is_file() for r in cooc)
