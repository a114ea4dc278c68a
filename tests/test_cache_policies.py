"""Every expert-cache replacement policy (cpp/src/moe/policies/) against an independent Python model of
the same policy written here from its stated rules, on random call sequences; the engine's per-layer
misses against the offline replay of the same policy (sharpi.cache_eval.replay, moe/policy_replay.h);
streamed == resident bit for bit under every policy; typed errors for bad names and prior files.
"""

from __future__ import annotations

import json
import math
import os
import random

import numpy as np
import pytest
import sharpi
from sharpi import _internal
from sharpi.belady import belady
from sharpi.cache_eval import Steps, capacity_for, fit_prior, replay, write_prior
from sharpi.make_model import write_model

POLICIES = ["lru", "slru", "lfu", "arc", "s3fifo", "prior", "predictive"]


# -- independent models, one per policy ---------------------------------------------------------


class RefLru:
    def __init__(self, capacity, **_):
        self.order: list = []  # most recent first

    def insert(self, s, key):
        self.remove(s)
        self.order.insert(0, s)

    def touch(self, s):
        if s in self.order:
            self.insert(s, None)

    def remove(self, s):
        if s in self.order:
            self.order.remove(s)

    def victim(self, pinned):
        return next((s for s in reversed(self.order) if s not in pinned), None)

    def gate(self, il):
        pass

    def protect(self, s, il):
        pass


class RefSlru(RefLru):
    def __init__(self, capacity, probation=0.25, **_):
        self.max_protected = math.floor(capacity * (1 - probation))
        self.prob: list = []
        self.prot: list = []

    def insert(self, s, key):
        self.remove(s)
        self.prob.insert(0, s)

    def touch(self, s):
        if s not in self.prob and s not in self.prot:
            return
        self.remove(s)
        self.prot.insert(0, s)
        while len(self.prot) > self.max_protected:
            self.prob.insert(0, self.prot.pop())

    def remove(self, s):
        for seg in (self.prob, self.prot):
            if s in seg:
                seg.remove(s)

    def victim(self, pinned):
        return next(
            (s for s in list(reversed(self.prob)) + list(reversed(self.prot)) if s not in pinned), None
        )


class RefLfu(RefLru):
    """score(key) = sum over its uses of growth**(uses of any expert before it); kept after eviction."""

    def __init__(self, capacity, lfu_half_life=0.0, **_):
        self.growth = 2.0 ** (1.0 / (lfu_half_life or 4.0 * max(capacity, 1)))
        self.weight = 1.0
        self.clock = 0
        self.score: dict = {}
        self.key_of: dict = {}
        self.last: dict = {}

    def _use(self, s):
        k = self.key_of[s]
        self.score[k] = self.score.get(k, 0.0) + self.weight
        self.clock += 1
        self.last[s] = self.clock
        self.weight *= self.growth

    def insert(self, s, key):
        self.key_of[s] = key
        self._use(s)

    def touch(self, s):
        if s in self.key_of:
            self._use(s)

    def remove(self, s):
        self.key_of.pop(s, None)

    def victim(self, pinned):
        c = [(self.score[self.key_of[s]], self.last[s], s) for s in self.key_of if s not in pinned]
        return min(c)[2] if c else None


class RefArc(RefLru):
    def __init__(self, capacity, **_):
        self.c = float(capacity)
        self.p = 0.0
        self.t1: list = []  # most recent first
        self.t2: list = []
        self.b1: list = []
        self.b2: list = []
        self.key_of: dict = {}

    def _trim(self):
        while self.b1 and len(self.t1) + len(self.b1) > self.c:
            self.b1.pop()
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * self.c:
            self.b2.pop()
        while self.b1 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * self.c:
            self.b1.pop()

    def insert(self, s, key):
        self.key_of[s] = key
        if key in self.b1:
            self.p = min(self.c, self.p + max(1.0, len(self.b2) / len(self.b1)))
            self.b1.remove(key)
            self.t2.insert(0, s)
        elif key in self.b2:
            self.p = max(0.0, self.p - max(1.0, len(self.b1) / len(self.b2)))
            self.b2.remove(key)
            self.t2.insert(0, s)
        else:
            self.t1.insert(0, s)
        self._trim()

    def touch(self, s):
        for t in (self.t1, self.t2):
            if s in t:
                t.remove(s)
                self.t2.insert(0, s)
                return

    def remove(self, s):
        for t, b in ((self.t1, self.b1), (self.t2, self.b2)):
            if s in t:
                t.remove(s)
                b.insert(0, self.key_of[s])
                self._trim()
                return

    def victim(self, pinned):
        first, second = (self.t1, self.t2) if self.t1 and len(self.t1) > self.p else (self.t2, self.t1)
        return next((s for s in list(reversed(first)) + list(reversed(second)) if s not in pinned), None)


class RefS3Fifo(RefLru):
    def __init__(self, capacity, s3fifo_small=0.1, **_):
        self.cap = capacity
        self.small_max = max(1, math.floor(capacity * s3fifo_small))
        self.small: list = []  # newest first
        self.main: list = []
        self.ghost: list = []  # newest first
        self.freq: dict = {}
        self.key_of: dict = {}

    def insert(self, s, key):
        self.key_of[s] = key
        self.freq[s] = 0
        if key in self.ghost:
            self.ghost.remove(key)
            self.main.insert(0, s)
        else:
            self.small.insert(0, s)

    def touch(self, s):
        if s in self.freq and (s in self.small or s in self.main):
            self.freq[s] = min(self.freq[s] + 1, 3)

    def remove(self, s):
        if s in self.small:
            self.small.remove(s)
            self.ghost.insert(0, self.key_of[s])
            del self.ghost[self.cap :]
        elif s in self.main:
            self.main.remove(s)

    @staticmethod
    def _oldest(q, pinned):
        return next((s for s in reversed(q) if s not in pinned), None)

    def _from_small(self, pinned):
        """(victim or None, moved?)"""
        s = self._oldest(self.small, pinned)
        if s is None:
            return None, False
        if self.freq[s] == 0:
            return s, False
        self.small.remove(s)
        self.freq[s] = 0
        self.main.insert(0, s)
        return None, True

    def victim(self, pinned):
        for _ in range(4 * (len(self.small) + len(self.main)) + 1):
            if self.small and (len(self.small) >= self.small_max or not self.main):
                v, moved = self._from_small(pinned)
                if v is not None:
                    return v
                if moved:
                    continue
            m = self._oldest(self.main, pinned)
            if m is None:
                v, moved = self._from_small(pinned)
                if v is not None:
                    return v
                if not moved:
                    return None
                continue
            if self.freq[m] == 0:
                return m
            self.freq[m] -= 1
            self.main.remove(m)
            self.main.insert(0, m)
        return next((s for s in reversed(self.small + self.main) if s not in pinned), None)


class RefPrior(RefLru):
    def __init__(self, capacity, prior=None, prior_pin=0.5, **_):
        flat = prior.ravel()
        n_hot = min(len(flat), math.floor(prior_pin * capacity))
        rank = sorted(range(len(flat)), key=lambda i: -flat[i])  # stable: lower index first on ties
        self.n_expert = prior.shape[1]
        self.hot = {i for i in rank[:n_hot] if flat[i] > 0}
        self.cold_l: list = []
        self.hot_l: list = []
        self.is_hot: dict = {}

    def insert(self, s, key):
        self.remove(s)
        self.is_hot[s] = key[0] * self.n_expert + key[1] in self.hot
        (self.hot_l if self.is_hot[s] else self.cold_l).insert(0, s)

    def touch(self, s):
        if s in self.cold_l or s in self.hot_l:
            lst = self.hot_l if self.is_hot[s] else self.cold_l
            lst.remove(s)
            lst.insert(0, s)

    def remove(self, s):
        for lst in (self.cold_l, self.hot_l):
            if s in lst:
                lst.remove(s)

    def victim(self, pinned):
        return next(
            (s for s in list(reversed(self.cold_l)) + list(reversed(self.hot_l)) if s not in pinned), None
        )


class RefPredictive(RefLfu):
    def __init__(self, capacity, **kw):
        super().__init__(capacity, **kw)
        self.until: dict = {}
        self.last_gate = -1

    def remove(self, s):
        super().remove(s)
        self.until.pop(s, None)

    def gate(self, il):
        new_token = il < self.last_gate
        self.last_gate = il
        self.until = {s: u for s, u in self.until.items() if not new_token and u > il}

    def protect(self, s, il):
        if s in self.key_of:
            self.until[s] = max(self.until.get(s, il), il)

    def victim(self, pinned):
        if self.until:
            v = super().victim(set(pinned) | set(self.until))
            if v is not None:
                return v
        return super().victim(pinned)


REFS = {
    "lru": RefLru,
    "slru": RefSlru,
    "lfu": RefLfu,
    "arc": RefArc,
    "s3fifo": RefS3Fifo,
    "prior": RefPrior,
    "predictive": RefPredictive,
}


@pytest.mark.parametrize("name", POLICIES)
def test_bound_policy_matches_an_independent_model(name):
    rng = random.Random(hash(name) % 1000)
    n_layer, n_expert = 3, 5  # a small universe of keys, so ghosts and kept counts come back
    for trial in range(25):
        capacity = rng.randint(1, 10)
        knobs = {}
        if name == "lfu" or name == "predictive":
            knobs["lfu_half_life"] = rng.choice([0.0, 2.0, 16.0, 4096.0])
        if name == "slru":
            knobs["probation"] = rng.choice([0.25, 0.5, 1.0])
        if name == "s3fifo":
            knobs["s3fifo_small"] = rng.choice([0.1, 0.3, 0.5])
        if name == "prior":
            prior = np.array(
                [[rng.choice([0.0, 1.0, 2.0, 3.5]) for _ in range(n_expert)] for _ in range(n_layer)],
                dtype=np.float32,
            )
            knobs.update(prior=prior, prior_pin=rng.choice([0.0, 0.5, 1.0]))
        bound = _internal.ReplacementPolicy(name, capacity, **knobs)
        ref = REFS[name](capacity, **knobs)
        cached: dict = {}  # slot -> key
        for _ in range(300):
            op = rng.random()
            free = [s for s in range(capacity) if s not in cached]
            if op < 0.3 and free:
                s = rng.choice(free)
                key = rng.choice(
                    [
                        (il, e)
                        for il in range(n_layer)
                        for e in range(n_expert)
                        if (il, e) not in cached.values()
                    ]
                )
                bound.insert(s, *key)
                ref.insert(s, key)
                cached[s] = key
            elif op < 0.6 and cached:
                s = rng.choice(sorted(cached))
                bound.touch(s)
                ref.touch(s)
            elif op < 0.7 and cached:
                s = rng.choice(sorted(cached))
                bound.remove(s)
                ref.remove(s)
                del cached[s]
            elif op < 0.75:
                il = rng.randrange(n_layer)
                bound.gate(il)
                ref.gate(il)
            elif op < 0.8 and cached:
                s, il = rng.choice(sorted(cached)), rng.randrange(n_layer)
                bound.protect(s, il)
                ref.protect(s, il)
            else:
                pinned = rng.sample(sorted(cached), rng.randint(0, len(cached))) if cached else []
                v = bound.victim(pinned)
                assert v == ref.victim(set(pinned)), (trial, name)
                if v is not None and rng.random() < 0.7:  # evict it, as the cache would
                    bound.remove(v)
                    ref.remove(v)
                    del cached[v]
            assert len(bound) == len(cached)
            assert all((s in bound) == (s in cached) for s in range(capacity))


def test_replay_never_beats_belady_and_counts_every_access():
    rng = np.random.default_rng(7)
    n_tok, n_layer, n_expert, k = 60, 3, 8, 2
    experts = np.stack([rng.permutation(n_expert)[:k] for _ in range(n_tok * n_layer)]).reshape(
        n_tok, n_layer, k
    )
    steps = Steps(experts)
    sets = steps.key_sets(n_expert)
    prior = fit_prior_from(experts, n_expert)
    for cap in (k, 5, 12, n_layer * n_expert):
        opt = belady(sets, cap).misses
        for name in POLICIES:
            m = replay(name, steps, cap, prior=prior if name == "prior" else None)
            assert len(m) == n_tok * n_layer
            assert m.sum() >= opt, name
            if cap == n_layer * n_expert:  # everything fits: only compulsory misses
                assert m.sum() == len({(il, e) for il in range(n_layer) for e in np.unique(experts[:, il])})


def fit_prior_from(experts, n_expert):
    class T:
        pass

    t = T()
    t.experts, t.n_layer, t.n_expert = experts, experts.shape[1], n_expert
    return fit_prior(t, np.arange(experts.shape[0]))


def test_capacity_matches_bench_rounding():
    assert capacity_for(0.25, 26, 64, 6) == 416
    assert capacity_for(0.01, 6, 16, 2) == 2


# -- errors -------------------------------------------------------------------------------------


def test_unknown_policy_lists_the_known_ones(tmp_path):
    with pytest.raises(
        sharpi.InvalidArgument, match=r"unknown replacement policy 'mru' \(known: lru, slru, lfu"
    ):
        _internal.ReplacementPolicy("mru", 4)
    assert set(POLICIES) == set(sharpi.cache_policies())
    assert sharpi.default_cache_policy() in POLICIES
    with pytest.raises(sharpi.InvalidArgument, match="needs a prior file"):
        _internal.ReplacementPolicy("prior", 4)
    with pytest.raises(sharpi.InvalidArgument, match="half-life"):
        _internal.ReplacementPolicy("lfu", 4, lfu_half_life=-1.0)
    with pytest.raises(sharpi.InvalidArgument, match="small-queue share"):
        _internal.ReplacementPolicy("s3fifo", 4, s3fifo_small=1.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("policies_model") / "qwen3moe.gguf")
    write_model(path, arch="qwen3moe", preset="tiny", quant="q8_0", seed=5)
    return path


@pytest.fixture(scope="module")
def shape(model):
    s = sharpi.Session(model, threads=1, n_ctx=64, ram_budget="4GiB", reader="pread")
    st, info = s.expert_stats(), s.info
    return {
        "fixed": st["fixed_bytes"],
        "slot": st["slot_bytes"],
        "k": info["n_expert_used"],
        "n_expert": info["n_expert"],
        "n_layer": info["n_layer"],
    }


@pytest.fixture(scope="module")
def prior_file(tmp_path_factory, shape):
    path = str(tmp_path_factory.mktemp("prior") / "prior.gguf")
    rng = np.random.default_rng(1)
    write_prior(path, rng.random((shape["n_layer"], shape["n_expert"])).astype(np.float32), source="test")
    return path


def test_session_policy_errors(model, shape, prior_file, tmp_path):
    budget = shape["fixed"] + 4 * shape["k"] * shape["slot"]
    with pytest.raises(sharpi.InvalidArgument, match=r"unknown replacement policy 'belady'.*known: lru"):
        sharpi.Session(model, threads=1, n_ctx=64, ram_budget=budget, cache_policy="belady")
    with pytest.raises(sharpi.InvalidArgument, match="unknown replacement policy"):
        sharpi.Session(model, threads=1, n_ctx=64, cache_policy="nope")  # checked without a budget too
    with pytest.raises(sharpi.InvalidArgument, match="needs a prior file"):
        sharpi.Session(model, threads=1, n_ctx=64, ram_budget=budget, cache_policy="prior")
    with pytest.raises(sharpi.InvalidArgument, match="does not exist"):
        sharpi.Session(
            model, threads=1, n_ctx=64, ram_budget=budget, cache_policy="prior:" + str(tmp_path / "x")
        )
    with pytest.raises(sharpi.InvalidArgument, match="reads no file"):
        sharpi.Session(model, threads=1, n_ctx=64, ram_budget=budget, cache_policy="lru:" + prior_file)
    other = str(tmp_path / "other.gguf")
    write_prior(other, np.ones((shape["n_layer"] + 1, shape["n_expert"]), dtype=np.float32))
    with pytest.raises(sharpi.InvalidArgument, match="prior is for n_layer="):
        sharpi.Session(model, threads=1, n_ctx=64, ram_budget=budget, cache_policy="prior:" + other)
    with pytest.raises(sharpi.InvalidArgument, match="not a cache prior file"):
        sharpi.Session(model, threads=1, n_ctx=64, ram_budget=budget, cache_policy="prior:" + model)
    np.testing.assert_array_equal(
        _internal.read_cache_prior(other, shape["n_layer"] + 1, shape["n_expert"]),
        np.ones((shape["n_layer"] + 1, shape["n_expert"]), dtype=np.float32),
    )


# -- the engine -----------------------------------------------------------------------------------


def _policy_arg(name, prior_file):
    return f"prior:{prior_file}" if name == "prior" else name


@pytest.mark.parametrize("name", POLICIES)
def test_engine_misses_equal_the_replay(model, shape, prior_file, name):
    # Token-by-token decoding without a predictor: every layer of every token is one acquire of its
    # unique experts (sorted), so the engine's misses are exactly the replayed policy's.
    k, n_expert, n_layer = shape["k"], shape["n_expert"], shape["n_layer"]
    total = n_layer * n_expert
    prior = _internal.read_cache_prior(prior_file, n_layer, n_expert)
    for n_slots in sorted({k, 2 * k + 1, total // 3}):
        s = sharpi.Session(
            model,
            threads=1,
            n_ctx=64,
            ram_budget=shape["fixed"] + n_slots * shape["slot"],
            reader="pread",
            cache_policy=_policy_arg(name, prior_file),
        )
        routing = []
        token = 3
        for _ in range(40):
            logits = s.decode([token])
            routing.append([np.sort(np.ravel(ids)) for ids in s.last_routing()])
            token = int(np.argmax(logits))
        experts = np.array(routing, dtype=np.int16)  # [tokens, n_layer, k]
        misses = replay(name, Steps(experts), n_slots, prior=prior if name == "prior" else None)
        per_layer = [int(misses[il::n_layer].sum()) for il in range(n_layer)]
        assert [lay["misses"] for lay in s.expert_stats()["layers"]] == per_layer, (name, n_slots)


def _run_tokens(session, prompt, n_decode):
    rows = [session.decode(prompt, all_logits=True)]
    tokens = [int(np.argmax(rows[0][-1]))]
    for _ in range(n_decode):
        logits = session.decode([tokens[-1]])
        rows.append(logits[None, :])
        tokens.append(int(np.argmax(logits)))
    return tokens, np.concatenate(rows)


@pytest.fixture(scope="module")
def resident(model):
    return _run_tokens(sharpi.Session(model, threads=2, n_ctx=64), list(range(5, 25)), 16)


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("budget", ["tight", "roomy"])
def test_streamed_equals_resident_for_every_policy(model, shape, prior_file, resident, name, budget):
    total = shape["n_layer"] * shape["n_expert"]
    n_slots = shape["k"] if budget == "tight" else total // 2
    # The predictive policy is exercised with a predictor, so hints really protect slots.
    predictor = "prev_token" if name == "predictive" else "none"
    staging = shape["k"] if predictor != "none" else 0
    s = sharpi.Session(
        model,
        threads=2,
        n_ctx=64,
        reader="pread",
        predictor=predictor,
        ram_budget=shape["fixed"] + (n_slots + staging) * shape["slot"],
        cache_policy=_policy_arg(name, prior_file),
    )
    tokens, logits = _run_tokens(s, list(range(5, 25)), 16)
    assert tokens == resident[0]
    assert np.array_equal(logits, resident[1])  # bit for bit
    layers = s.expert_stats()["layers"]
    assert sum(lay["misses"] for lay in layers) > 0


# -- the offline evaluation and the prior command ---------------------------------------------------

SHIPPED_TRACE = os.path.join(os.path.dirname(__file__), "data", "stdlib_moe_trace.npz")


def test_cache_eval_and_cache_prior_commands(tmp_path, capsys):
    from sharpi import cli
    from sharpi.predict.traces import load_trace, split_by_sequences

    out_json = tmp_path / "eval.json"
    assert (
        cli.main(["cache-eval", "--trace", SHIPPED_TRACE, "--budgets", "10,25,50", "--json", str(out_json)])
        == 0
    )
    text = capsys.readouterr().out
    assert all(f"| {name} |" in text for name in POLICIES)
    (res,) = json.loads(out_json.read_text())
    assert [b["capacity"] for b in res["budgets"]] == [10, 24, 48]  # round(share * 6 * 16)
    for b in res["budgets"]:
        for name, p in b["policies"].items():
            assert p["misses"] >= b["belady"] > 0, name  # no demand policy beats the optimum

    prior_path = tmp_path / "prior.gguf"
    assert cli.main(["cache-prior", "--trace", SHIPPED_TRACE, "-o", str(prior_path)]) == 0
    trace = load_trace(SHIPPED_TRACE)
    split = split_by_sequences(trace)
    got = _internal.read_cache_prior(str(prior_path), trace.n_layer, trace.n_expert)
    want = np.zeros((trace.n_layer, trace.n_expert))
    for t in split.train:  # the train sequences only: counts per token
        for il in range(trace.n_layer):
            for e in trace.experts[t, il]:
                want[il, e] += 1.0 / len(split.train)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_cache_eval_horizons_span_lru_to_belady(capsys):
    """belady@0 knows no future and is LRU (sharpi.belady.lru); belady@N for N beyond the held-out
    tokens is Belady itself; on the shipped model's real routing, knowing the next token's routing
    is still far from the goal of 1.15x at 25% (docs/cache_policies.md)."""
    from sharpi import cli
    from sharpi.belady import belady_horizon, lru
    from sharpi.cache_eval import Steps, capacity_for, evaluate
    from sharpi.predict.traces import load_trace, split_by_sequences

    assert cli.main(["cache-eval", "--trace", SHIPPED_TRACE, "--budgets", "25", "--policies", "lru",
                     "--horizons", "1,100000"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "| belady@1 |" in text and "| belady@100000 |" in text
    (b,) = evaluate(SHIPPED_TRACE, [0.25], ["lru"], horizons=[1, 100000])["budgets"]
    p = b["policies"]
    assert p["belady@100000"]["misses"] == b["belady"]
    assert b["belady"] <= p["belady@1"]["misses"] <= p["lru"]["misses"]
    assert p["belady@1"]["ratio"] > 1.15

    trace = load_trace(SHIPPED_TRACE)
    steps = Steps(trace.experts[split_by_sequences(trace).eval]).key_sets(trace.n_expert)
    cap = capacity_for(0.25, trace.n_layer, trace.n_expert, trace.top_k)
    assert belady_horizon(steps, cap, 0).misses == lru(steps, cap).misses
    with pytest.raises(SystemExit):
        cli.main(["cache-eval", "--trace", SHIPPED_TRACE, "--horizons", "-1"])


def test_policies_on_held_out_deepseek_routing(shared_traces):
    from sharpi.cache_eval import evaluate

    res = evaluate(str(shared_traces / "deepseek_v2_lite_train.npz"), [0.25], max_eval_tokens=1500)
    (b,) = res["budgets"]
    assert b["capacity"] == 416
    ratios = {name: p["ratio"] for name, p in b["policies"].items()}
    assert all(r >= 1.0 for r in ratios.values()), ratios
    # The default is the best at 25% (docs/cache_policies.md), by a margin no knob reversed.
    assert ratios[sharpi.default_cache_policy()] <= min(ratios.values()) + 0.02, ratios
