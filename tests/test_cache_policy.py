"""The expert cache's replacement policy as bound to Python (sharpi._internal.ReplacementPolicy), against
an independent list-based SLRU written here, and the engine's own cache against an offline replay
of the same policy (sharpi.belady.slru): one policy code, used by the engine and by trace replay.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import sharpi
from sharpi import _internal
from sharpi.belady import belady, belady_horizon, lru, slru
from sharpi.make_model import write_model


class ListSlru:
    """SLRU as docs/design.md §4 states it, with plain lists (most recent first)."""

    def __init__(self, capacity: int, probation: float):
        self.max_protected = math.floor(capacity * (1.0 - probation))
        self.probation: list = []
        self.protected: list = []

    def remove(self, s):
        for seg in (self.probation, self.protected):
            if s in seg:
                seg.remove(s)

    def insert(self, s):
        self.remove(s)
        self.probation.insert(0, s)

    def touch(self, s):
        self.remove(s)
        self.protected.insert(0, s)
        while len(self.protected) > self.max_protected:
            self.probation.insert(0, self.protected.pop())

    def victim(self, pinned):
        for seg in (self.probation, self.protected):
            for s in reversed(seg):
                if s not in pinned:
                    return s
        return None


@pytest.mark.parametrize("probation", [0.25, 0.5, 0.9, 1.0])
def test_bound_slru_matches_a_list_model(probation):
    rng = random.Random(int(probation * 100))
    for _ in range(30):
        capacity = rng.randint(1, 12)
        bound = _internal.ReplacementPolicy("slru", capacity, probation=probation)
        ref = ListSlru(capacity, probation)
        cached: set = set()
        for _ in range(200):
            op = rng.random()
            if op < 0.4 and len(cached) < capacity:
                s = rng.choice([i for i in range(capacity) if i not in cached])
                bound.insert(s)
                ref.insert(s)
                cached.add(s)
            elif op < 0.75 and cached:
                s = rng.choice(sorted(cached))
                bound.touch(s)
                ref.touch(s)
            elif op < 0.85 and cached:
                s = rng.choice(sorted(cached))
                bound.remove(s)
                ref.remove(s)
                cached.discard(s)
            else:
                pinned = rng.sample(sorted(cached), rng.randint(0, len(cached))) if cached else []
                assert bound.victim(pinned) == ref.victim(set(pinned))
            assert len(bound) == len(cached)
            assert all((s in bound) == (s in cached) for s in range(capacity))


def test_policy_errors():
    with pytest.raises(sharpi.InvalidArgument, match="unknown replacement policy 'mru'"):
        _internal.ReplacementPolicy("mru", 4)
    with pytest.raises(sharpi.InvalidArgument, match="probation share"):
        _internal.ReplacementPolicy("slru", 4, probation=0.0)
    assert "slru" in _internal.replacement_policy_names()
    p = _internal.ReplacementPolicy("slru", 2)
    assert p.name == "slru" and p.victim() is None
    p.insert(0)
    assert p.victim([0]) is None and p.victim() == 0


def test_offline_replays_bound_optimum():
    rng = random.Random(3)
    for _ in range(20):
        universe, capacity = rng.randint(4, 30), rng.randint(3, 12)
        steps = [set(rng.sample(range(universe), rng.randint(1, 3))) for _ in range(rng.randint(5, 80))]
        opt = belady(steps, capacity).misses
        assert opt <= lru(steps, capacity).misses
        assert opt <= slru(steps, capacity).misses
        assert slru(steps, capacity).accesses == sum(len(s) for s in steps)


def test_belady_horizon_spans_lru_to_belady():
    """Knowing no future is exactly LRU; knowing all of it is exactly Belady (both independent
    implementations); any horizon in between never beats Belady (it is a demand policy)."""
    rng = random.Random(5)
    for _ in range(30):
        n_expert, n_layer, k = rng.randint(3, 10), rng.randint(1, 3), rng.randint(1, 3)
        k = min(k, n_expert)
        steps = [
            {il * n_expert + e for e in rng.sample(range(n_expert), k)}
            for _ in range(rng.randint(5, 60))
            for il in range(n_layer)
        ]
        capacity = rng.randint(k, n_layer * n_expert)
        opt = belady(steps, capacity).misses
        assert belady_horizon(steps, capacity, 0).misses == lru(steps, capacity).misses
        assert belady_horizon(steps, capacity, math.inf).misses == opt
        assert belady_horizon(steps, capacity, len(steps)).misses == opt
        for h in (1, 2, n_layer, 3 * n_layer):
            r = belady_horizon(steps, capacity, h)
            assert r.misses >= opt and r.accesses == sum(len(s) for s in steps)
    with pytest.raises(ValueError, match="horizon"):
        belady_horizon([{1}], 1, -1)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("policy_model") / "qwen3moe.gguf")
    write_model(path, arch="qwen3moe", preset="tiny", quant="q8_0", seed=5)
    return path


@pytest.mark.parametrize("probation", [0.25, 0.5])
def test_engine_cache_misses_equal_the_offline_replay(model, probation):
    # Token-by-token decoding without a predictor: every layer of every token is one acquire of
    # its unique experts, so the engine's misses are exactly the replayed policy's.
    probe = sharpi.Session(model, threads=1, n_ctx=64, ram_budget="4GiB", reader="pread")
    st = probe.expert_stats()
    info = probe.info
    fixed, slot = st["fixed_bytes"], st["slot_bytes"]
    k, n_expert, n_layer = info["n_expert_used"], info["n_expert"], info["n_layer"]
    total = n_layer * n_expert
    for n_slots in sorted({k, 2 * k + 1, total // 3, total // 2}):
        s = sharpi.Session(
            model,
            threads=1,
            n_ctx=64,
            ram_budget=fixed + n_slots * slot,
            reader="pread",
            slru_probation=probation,
            cache_policy="slru",
        )
        steps = []
        token = 3
        for _ in range(40):
            logits = s.decode([token])
            for il, ids in enumerate(s.last_routing()):
                steps.append(frozenset(il * n_expert + int(e) for e in np.ravel(ids)))
            token = int(np.argmax(logits))
        layers = s.expert_stats()["layers"]
        replay = slru(steps, n_slots, probation=probation)
        per_layer = [sum(replay.misses_per_step[il::n_layer]) for il in range(n_layer)]
        assert [lay["misses"] for lay in layers] == per_layer, n_slots
        assert replay.misses >= belady(steps, n_slots).misses
