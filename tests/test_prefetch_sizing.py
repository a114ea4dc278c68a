"""Byte-sized prediction sets (issue 16, docs/predictors.md "Byte-sized prediction sets").

Oracle: a float64 numpy model of the rule, written from the documentation: probabilities
p = min(1, k * softmax(scores)) per target layer, the prediction set {p > 1/2}, and reads of its
members that are not present, best expected saving first (saving = (2p - 1) * b/B, each read's bytes
queued ahead of the next; a read that could only start after its layer's gate is not issued), while the
saving is positive and a staging slot is free.
Inputs are fresh random draws on every run; the seed is in every failure message.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import sharpi
from sharpi import _internal
from sharpi.make_model import write_model
from test_predictors import N_LAYER, PROMPT, plan, recorded_routing, streamed
from test_streaming import run_tokens


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("sizing_models") / "olmoe.gguf")
    write_model(path, arch="olmoe", preset="tiny", quant="q4_k_m", seed=5, n_layer=N_LAYER)
    return path


def numpy_plan(source, top_k, hints, present, expert_bytes, bytes_per_ms, queued, layer_ms, timeliness, free_slots):
    """The rule in float64 numpy: (sets, reads, skipped) as the binding returns them."""
    # Nearest target first, best score first, stable; a repeated (target, expert) keeps its first score.
    order = sorted(range(len(hints)), key=lambda i: (hints[i][0], -np.float32(hints[i][2])))
    by_target: dict = {}
    for i in order:
        t, e, s = hints[i]
        experts = by_target.setdefault(t, {})
        if e not in experts:
            experts[e] = float(np.float32(s))
    sets, candidates = [], []
    for t in sorted(by_target):
        experts = list(by_target[t])
        s = np.array([by_target[t][e] for e in experts], dtype=np.float64)
        top = s.max()
        w = np.where(s == top, 1.0, np.exp(s - top))
        p = np.minimum(1.0, top_k * w / w.sum())
        members = [(e, pe) for e, pe in zip(experts, p) if pe > 0.5]
        if members:
            sets.append((t, [e for e, _ in members]))
        candidates += [(t, e, pe, float(expert_bytes[t])) for e, pe in members if not present[t, e]]
    timed = timeliness and bytes_per_ms > 0 and layer_ms > 0
    bw = bytes_per_ms if bytes_per_ms > 0 else 1.0
    taken = np.zeros(len(candidates), dtype=bool)
    reads = []
    while free_slots > 0 and candidates:
        t = np.array([c[0] for c in candidates], dtype=np.float64)
        p = np.array([c[2] for c in candidates])
        read_ms = np.array([c[3] for c in candidates]) / bw
        late = queued / bw > (t - source) * layer_ms if timed else np.zeros(len(candidates), dtype=bool)
        saving = np.where(taken | late, -np.inf, p * read_ms - (1 - p) * read_ms)
        best = int(np.argmax(saving))  # the first maximum: candidate order breaks ties
        if not saving[best] > 0:
            break
        taken[best] = True
        reads.append(candidates[best][:2])
        queued += candidates[best][3]
        free_slots -= 1
    skipped = [c[:2] for c, used in zip(candidates, taken) if not used]
    return sets, reads, skipped


def random_case(rng):
    n_layer = int(rng.integers(2, 9))
    n_expert = int(rng.integers(2, 65))
    top_k = int(rng.integers(1, min(n_expert, 8) + 1))
    lookahead = int(rng.integers(1, 4))
    source = int(rng.integers(0, n_layer - 1))
    hints = []
    for t in range(source + 1, min(n_layer, source + lookahead + 1)):
        kind = rng.integers(0, 3)
        n = n_expert if kind == 0 else int(rng.integers(1, n_expert + 1))  # every expert, or a subset
        experts = rng.permutation(n_expert)[:n]
        scale = float(rng.choice([0.1, 1.0, 3.0, 10.0]))
        scores = (scale * rng.standard_normal(n)).astype(np.float32)
        if kind == 2:  # ranks, as prev_token gives them
            scores = np.arange(n, 0, -1).astype(np.float32)
        hints += [(t, int(e), float(s)) for e, s in zip(experts, scores)]
        if rng.random() < 0.3 and n > 1:  # repeats with a lower score: count once
            hints.append((t, int(experts[0]), float(scores.min()) - 1.0))
    rng.shuffle(hints)
    hints = [tuple(h) for h in hints]
    present = rng.random((n_layer, n_expert)) < rng.random()
    expert_bytes = rng.integers(1 << 16, 1 << 24, size=n_layer).astype(np.float64)
    bytes_per_ms = float(rng.choice([0.0, rng.uniform(1e5, 2e6)]))
    queued = float(rng.integers(0, 1 << 26)) if rng.random() < 0.7 else 0.0
    layer_ms = float(rng.choice([0.0, rng.uniform(1.0, 60.0)]))
    timeliness = bool(rng.random() < 0.8)
    free_slots = int(rng.integers(0, lookahead * top_k + 1))
    return (source, top_k, [(int(t), int(e), float(s)) for t, e, s in hints], present, expert_bytes, bytes_per_ms,
            queued, layer_ms, timeliness, free_slots)


def test_byte_sized_plan_matches_the_numpy_model():
    seed = int.from_bytes(os.urandom(8), "little")
    rng = np.random.default_rng(seed)
    n_reads = n_skipped = n_short = 0
    for case in range(400):
        args = random_case(rng)
        got = _internal.byte_sized_prefetch(*args)
        sets, reads, skipped = numpy_plan(*args)
        what = f"seed {seed} case {case}"
        assert [(t, list(s)) for t, s in got["sets"]] == sets, what
        assert [tuple(r) for r in got["reads"]] == reads, what
        assert sorted(tuple(r) for r in got["skipped"]) == sorted(skipped), what
        assert len(reads) <= args[-1], what  # never more reads than free staging slots
        n_reads += len(reads)
        n_skipped += len(skipped)
        n_short += any(len(s) < args[1] for _, s in sets)
    # The draws exercise every branch: reads issued, reads refused, sets smaller than k.
    assert n_reads > 0 and n_skipped > 0 and n_short > 0, f"seed {seed}"


def test_byte_sized_plan_worked_example():
    # Two target layers, k = 2, 1 MB experts at 1 MB/ms, 10 ms per layer, nothing queued.
    # Layer 1: scores ln(8), ln(1), ln(1) -> softmax 0.8, 0.1, 0.1 -> p = 1, 0.2, 0.2: set {5}.
    # Layer 2: scores 0, 0 -> p = 1, 1: set {3, 4}; 4 is present. Savings 1 ms each; with one queued
    # MB ahead, layer 2's read still starts before its gate (1 ms < 2 * 10 ms); 5 (nearer) goes first.
    hints = [(1, 5, np.log(8.0)), (1, 6, 0.0), (1, 7, 0.0), (2, 3, 0.0), (2, 4, 0.0)]
    present = np.zeros((3, 8), dtype=bool)
    present[2, 4] = True
    out = _internal.byte_sized_prefetch(0, 2, hints, present, [1e6, 1e6, 1e6], 1e6, 0.0, 10.0, True, 4)
    assert [(t, list(s)) for t, s in out["sets"]] == [(1, [5]), (2, [3, 4])]
    assert [tuple(r) for r in out["reads"]] == [(1, 5), (2, 3)]
    # One slot: only the first.
    out = _internal.byte_sized_prefetch(0, 2, hints, present, [1e6, 1e6, 1e6], 1e6, 0.0, 10.0, True, 1)
    assert [tuple(r) for r in out["reads"]] == [(1, 5)] and [tuple(r) for r in out["skipped"]] == [(2, 3)]
    # 25 MB queued: both reads would start after their gates (25 ms > 10 ms, 20 ms): skipped. 15 MB:
    # only layer 2's starts in time. Without the timeliness test both go out.
    out = _internal.byte_sized_prefetch(0, 2, hints, present, [1e6, 1e6, 1e6], 1e6, 25e6, 10.0, True, 4)
    assert out["reads"] == [] and len(out["skipped"]) == 2
    out = _internal.byte_sized_prefetch(0, 2, hints, present, [1e6, 1e6, 1e6], 1e6, 15e6, 10.0, True, 4)
    assert [tuple(r) for r in out["reads"]] == [(2, 3)] and [tuple(r) for r in out["skipped"]] == [(1, 5)]
    # Bytes order the reads: layer 2's experts are 3 MB, so its read saves more and goes first.
    out = _internal.byte_sized_prefetch(0, 2, hints, present, [1e6, 1e6, 3e6], 1e6, 0.0, 10.0, True, 4)
    assert [tuple(r) for r in out["reads"]] == [(2, 3), (1, 5)]
    out = _internal.byte_sized_prefetch(0, 2, hints, present, [1e6, 1e6, 1e6], 1e6, 25e6, 10.0, False, 4)
    assert [tuple(r) for r in out["reads"]] == [(1, 5), (2, 3)]


def test_prefetch_sizing_name_is_checked(olmoe):
    k = plan(olmoe)[2]
    with pytest.raises(sharpi.InvalidArgument, match="prefetch_sizing"):
        streamed(olmoe, k, 1, predictor="prev_token", prefetch_sizing="bits")


class ScoredPredictor(sharpi.Predictor):
    """Hints fixed scores for every expert of the next layer and records the sets numpy expects."""

    def __init__(self, n_expert, k, seed):
        self.rng = np.random.default_rng(seed)
        self.n_expert, self.k = n_expert, k
        self.expected_set_sizes = np.zeros(N_LAYER, dtype=np.int64)

    def observe(self, layer, hidden, router_logits, history, prev):
        if layer + 1 >= N_LAYER:
            return []
        scores = (3.0 * self.rng.standard_normal(self.n_expert)).astype(np.float32)
        w = np.exp(scores.astype(np.float64) - scores.max())
        p = np.minimum(1.0, self.k * w / w.sum())
        self.expected_set_sizes[layer + 1] += int((p > 0.5).sum())
        return [(layer + 1, e, float(s)) for e, s in enumerate(scores)]


def test_engine_sets_follow_the_rule_and_stay_lossless(olmoe):
    seed = int.from_bytes(os.urandom(4), "little")
    path = olmoe
    _, _, k = plan(path)
    n_expert = sharpi.Session(path, threads=1, n_ctx=16).info["n_expert"]
    n_decode = 12
    resident = run_tokens(sharpi.Session(path, threads=2, n_ctx=128), PROMPT, n_decode)
    pred = ScoredPredictor(n_expert, k, seed)
    s = streamed(path, k, 1, predictor=pred, prefetch_sizing="bytes")
    np.testing.assert_array_equal(run_tokens(s, PROMPT, n_decode), resident, err_msg=f"seed {seed}")
    layers = s.expert_stats()["layers"]
    np.testing.assert_array_equal([lay["predicted_experts"] for lay in layers], pred.expected_set_sizes,
                                  err_msg=f"seed {seed}")
    issued = sum(lay["prefetch_issued"] for lay in layers)
    assert issued <= pred.expected_set_sizes.sum()

    # A perfect predictor scored as equals: p = 1 for each of its k experts, every read used.
    routing = recorded_routing(path, n_decode)

    class Perfect(sharpi.Predictor):
        def __init__(self):
            self.step = 0

        def observe(self, layer, hidden, router_logits, history, prev):
            step = self.routing_step()
            if layer == N_LAYER - 1:
                self.step += 1
            return [] if layer + 1 >= N_LAYER else [(layer + 1, int(e), 0.0) for e in step[layer + 1]]

        def routing_step(self):
            return routing[min(self.step, len(routing) - 1)]

    s = streamed(path, k, 1, predictor=Perfect(), prefetch_sizing="bytes")
    np.testing.assert_array_equal(run_tokens(s, PROMPT, n_decode), resident)
    layers = s.expert_stats()["layers"]
    assert sum(lay["predicted_correct"] for lay in layers) == n_decode * (N_LAYER - 1) * k
    issued = sum(lay["prefetch_issued"] for lay in layers)
    assert issued > 0 and sum(lay["prefetch_used"] for lay in layers) == issued
    assert sum(lay["prefetch_wasted_bytes"] for lay in layers) == 0
