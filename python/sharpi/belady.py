"""Offline replacement policies on a recorded expert-access sequence: Belady's optimum, LRU and SLRU.

What it owns: pure functions over a sequence of *steps*; nothing here touches files or clocks. LRU
and SLRU are not written here: they replay the engine's own policy code (sharpi._core.
ReplacementPolicy, cpp/src/moe/replacement_policy.h) so that an offline comparison measures the
policy the engine runs. A step is the set of experts one layer of one token needs at once (keys are any hashable,
usually `il * n_expert + e`), in the order the decode thread acquires them: token by token, layer by
layer. The cache holds `capacity` experts; every expert of a step must be resident while that step
runs, so an expert needed by the current step is never evicted (the engine pins them the same way).
Every policy here is demand-only: an expert enters the cache only when a step needs it.

Belady (MIN): on a miss with the cache full, evict the resident expert, not needed by the current
step, whose next use lies farthest in the future (never used again counts as infinitely far). With
the pin rule this is optimal for step sequences too (tests check it against exhaustive search), so
its miss count is a lower bound for every demand policy with the same capacity — SLRU, LRU, LFU or
anything an engine does without prefetching.

Warm start. A benchmark measures decode after a warm-up, with whatever the warm-up left cached. Any
demand cache's content then is some subset of the experts the warm-up touched, of size <= capacity.
`belady(..., warm=S)` starts from the best such content for the measured steps: the `capacity`
experts of S with the earliest next use (the same choice Belady's rule makes when it must shrink
the cache), so its misses bound every policy that saw that warm-up. LRU instead is simulated on the
warm-up steps themselves (`lru(warmup + steps, ..., count_from=len(warmup))`) because that is what an
LRU engine would really hold.

LRU is the engine's SLRU with the whole cache in probation (probation=1), which is exactly LRU.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from . import _internal

_NEVER = float("inf")


@dataclass
class PolicyResult:
    """Misses of one policy run. misses_per_step[i] counts the misses of steps[i] (counted steps only;
    uncounted warm-up steps report 0), so per-layer bytes can be summed by the caller."""

    misses: int
    accesses: int
    misses_per_step: list = field(default_factory=list)

    @property
    def hits(self) -> int:
        return self.accesses - self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0


def _as_steps(steps: Iterable[Iterable[Hashable]], capacity: int) -> list:
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    out = []
    for i, step in enumerate(steps):
        s = frozenset(step)
        if len(s) > capacity:
            raise ValueError(f"step {i} needs {len(s)} experts at once but the cache holds only {capacity}")
        out.append(s)
    return out


def _next_use_table(steps: Sequence[frozenset]) -> list:
    """nxt[i][key] = index of the first step after i that needs key (inf if none), for key in steps[i]."""
    nxt: list = [None] * len(steps)
    upcoming: dict = {}
    for i in range(len(steps) - 1, -1, -1):
        nxt[i] = {key: upcoming.get(key, _NEVER) for key in steps[i]}
        for key in steps[i]:
            upcoming[key] = i
    return nxt


def _first_use(steps: Sequence[frozenset]) -> dict:
    first: dict = {}
    for i, s in enumerate(steps):
        for key in s:
            first.setdefault(key, i)
    return first


def belady(steps: Iterable[Iterable[Hashable]], capacity: int, warm: Iterable[Hashable] = ()) -> PolicyResult:
    """Misses of Belady's optimal replacement on `steps` with `capacity` slots.

    warm: experts that may be resident before the first step (see the module note); the best
    `capacity` of them are. Raises ValueError when a step needs more experts than `capacity`.
    """
    seq = _as_steps(steps, capacity)
    nxt = _next_use_table(seq)
    first = _first_use(seq)

    # Resident set with a lazy max-heap on next use: entries (-next_use, tiebreak, key) go stale when
    # the key is used again or evicted; `next_of` holds the current truth.
    next_of: dict = {}
    heap: list = []
    counter = 0
    warm_keys = sorted(set(warm), key=lambda k: (first.get(k, _NEVER), repr(k)))
    for key in warm_keys[:capacity]:
        next_of[key] = first.get(key, _NEVER)
        heap.append((-next_of[key], counter, key))
        counter += 1
    heapq.heapify(heap)

    misses_per_step = []
    total = 0
    accesses = 0
    for i, need in enumerate(seq):
        missing = [key for key in need if key not in next_of]
        n_evict = len(next_of) + len(missing) - capacity
        while n_evict > 0:
            neg_next, _, key = heapq.heappop(heap)
            if next_of.get(key) != -neg_next or key in need:
                # Stale entry, or an expert this step needs: its entry is refreshed below anyway.
                continue
            del next_of[key]
            n_evict -= 1
        for key in need:
            next_of[key] = nxt[i][key]
            heapq.heappush(heap, (-next_of[key], counter, key))
            counter += 1
        misses_per_step.append(len(missing))
        total += len(missing)
        accesses += len(need)
        if len(heap) > 4 * capacity + 64:  # drop stale entries now and then: memory stays O(capacity)
            heap = [entry for entry in heap if next_of.get(entry[2]) == -entry[0]]
            heapq.heapify(heap)
    return PolicyResult(total, accesses, misses_per_step)


def belady_horizon(steps: Iterable[Iterable[Hashable]], capacity: int, horizon: float) -> PolicyResult:
    """Misses of Belady's rule when only the next `horizon` steps of the future are known (cold start).

    On a miss with the cache full it evicts, among resident experts the current step does not need,
    first those with no use within the next `horizon` steps, least recently used first (ties: the
    smaller key, touched earlier within its step, as `lru` orders them); then those with a known use,
    farthest first. horizon = 0 knows nothing and is exactly `lru`; a horizon beyond the sequence
    knows everything and has `belady`'s misses. In between it measures how much of Belady's advantage
    comes from knowing the routing `horizon` steps ahead, which is what a perfect predictor with that
    lookahead would tell an online cache. Keys must be sortable (as `lru` orders them).
    """
    import numpy as np

    if horizon < 0:
        raise ValueError(f"horizon must be >= 0, got {horizon}")
    seq = _as_steps(steps, capacity)
    nxt = _next_use_table(seq)
    keys = sorted(set().union(*seq)) if seq else []
    index = {key: j for j, key in enumerate(keys)}
    n = len(keys)
    resident = np.zeros(n, dtype=bool)
    next_use = np.full(n, _NEVER)
    # Recency rank: later steps rank higher; within a step, the larger key was touched later.
    last_rank = np.full(n, -1.0)
    order = np.arange(n, dtype=np.float64)
    beyond_base = 4.0 * (len(seq) + 1) * (n + 1)  # above every within-horizon score (step indices)
    n_resident = 0
    misses_per_step = []
    total = accesses = 0
    for i, need in enumerate(seq):
        idx = [index[key] for key in need]
        missing = [j for j in idx if not resident[j]]
        n_evict = n_resident + len(missing) - capacity
        if n_evict > 0:
            within = next_use - i <= horizon
            score = np.where(within, next_use, beyond_base - last_rank)
            score[~resident] = -np.inf
            score[idx] = -np.inf  # the step's own experts are pinned
            victims = np.argpartition(-score, n_evict - 1)[:n_evict]
            resident[victims] = False
            n_resident -= n_evict
        resident[missing] = True
        n_resident += len(missing)
        for key in need:
            j = index[key]
            next_use[j] = nxt[i][key]
            last_rank[j] = i * (n + 1) + order[j]
        misses_per_step.append(len(missing))
        total += len(missing)
        accesses += len(need)
    return PolicyResult(total, accesses, misses_per_step)


def lru(steps: Iterable[Iterable[Hashable]], capacity: int, count_from: int = 0) -> PolicyResult:
    """Misses of least-recently-used replacement (cold start), counting steps[count_from:] only.

    Within a step, the experts of the step are all touched before any eviction choice, so none of
    them is evicted by its own step. Raises ValueError when a step needs more than `capacity`.
    Replays the engine's SLRU with probation=1 (plain LRU): the step's evictions first (oldest
    first, skipping the step's experts), then its experts touched or inserted in key order.
    """
    seq = _as_steps(steps, capacity)
    policy = _internal.ReplacementPolicy("slru", capacity, probation=1.0)
    cache = _SlotMap(capacity)
    misses_per_step = []
    total = 0
    accesses = 0
    for i, need in enumerate(seq):
        missing = [key for key in need if key not in cache.slot_of]
        n_evict = len(cache.slot_of) + len(missing) - capacity
        if n_evict > 0:
            pinned = [cache.slot_of[key] for key in need if key in cache.slot_of]
            for _ in range(n_evict):
                cache.evict(policy, pinned)
        for key in _ordered(need):
            if key in cache.slot_of:
                policy.touch(cache.slot_of[key])
            else:
                policy.insert(cache.add(key))
        counted = i >= count_from
        misses_per_step.append(len(missing) if counted else 0)
        if counted:
            total += len(missing)
            accesses += len(need)
    return PolicyResult(total, accesses, misses_per_step)


def slru(
    steps: Iterable[Iterable[Hashable]], capacity: int, probation: float = 0.25, count_from: int = 0
) -> PolicyResult:
    """Misses of the engine's SLRU (demand only, cold start), counting steps[count_from:] only.

    The calls follow ExpertCache::acquire: the step's resident experts are touched in key order
    (and pinned), then each missing one, in key order, evicts the policy's victim when the cache is
    full and is inserted. Raises ValueError when a step needs more than `capacity`.
    """
    seq = _as_steps(steps, capacity)
    policy = _internal.ReplacementPolicy("slru", capacity, probation=probation)
    cache = _SlotMap(capacity)
    misses_per_step = []
    total = 0
    accesses = 0
    for i, need in enumerate(seq):
        keys = _ordered(need)
        pinned = []
        missing = []
        for key in keys:
            if key in cache.slot_of:
                policy.touch(cache.slot_of[key])
                pinned.append(cache.slot_of[key])
            else:
                missing.append(key)
        for key in missing:
            if len(cache.slot_of) >= capacity:
                cache.evict(policy, pinned)
            slot = cache.add(key)
            policy.insert(slot)
            pinned.append(slot)
        counted = i >= count_from
        misses_per_step.append(len(missing) if counted else 0)
        if counted:
            total += len(missing)
            accesses += len(need)
    return PolicyResult(total, accesses, misses_per_step)


class _SlotMap:
    """Keys <-> the slot ids a bound policy orders (0 .. capacity-1), as the cache's slots are."""

    def __init__(self, capacity: int):
        self.slot_of: dict = {}
        self.key_of: dict = {}
        self.free = list(range(capacity - 1, -1, -1))

    def add(self, key) -> int:
        slot = self.free.pop()
        self.slot_of[key] = slot
        self.key_of[slot] = key
        return slot

    def evict(self, policy, pinned) -> None:
        slot = policy.victim(pinned)
        if slot is None:  # cannot happen while every step fits the cache (_as_steps checks)
            raise RuntimeError("replacement policy found no victim")
        policy.remove(slot)
        del self.slot_of[self.key_of.pop(slot)]
        self.free.append(slot)


def _ordered(keys) -> list:
    try:
        return sorted(keys)
    except TypeError:  # keys of mixed types: any fixed order will do
        return sorted(keys, key=repr)


def steps_from_routing(routing_per_token: Iterable[Sequence], n_expert: int) -> list:
    """Step sets from recorded routing: routing_per_token[t][il] lists the experts layer il chose for
    token t (negative ids are ignored). Keys are il * n_expert + e, in acquisition order (token by
    token, layer by layer)."""
    steps = []
    for per_layer in routing_per_token:
        for il, ids in enumerate(per_layer):
            steps.append(frozenset(il * n_expert + int(e) for e in ids if int(e) >= 0))
    return steps
