"""The thread pool's cost counters (SHARPI_POOL_STATS=1, threads/thread_pool.h ThreadPoolStats), used by
benchmarks/bench_threadpool.py to set wake-up and barrier time against TPOT. Each case runs in a child
process: the pool reads the variable when it is built, and the counters are process-wide.

Oracles: the counters' own invariants (time in bodies fits in threads x region time, every worker that
joined a region was one of its threads, the barrier is part of the region) and wall time measured
outside the engine (regions fit inside the decode loop's perf_counter time); off means all zero; and
the logits are the same bits with the counters on and off.
"""

import json
import os
import subprocess
import sys

import pytest
from subprocess_env import child_env

CHILD = r"""
import hashlib, json, time
import numpy as np
import sharpi
from sharpi import _internal
from sharpi.models import default_model_path

s = sharpi.Session(str(default_model_path()), threads=2, n_ctx=64)
token = int(np.argmax(s.decode(list(range(1, 40)))))  # a prompt long enough for parallel attention
_internal.thread_pool_stats(reset=True)
logits = []
t0 = time.perf_counter()
for _ in range(4):
    logits.append(s.decode([token]))
    token = int(np.argmax(logits[-1]))
wall_ns = (time.perf_counter() - t0) * 1e9
stats = _internal.thread_pool_stats(reset=True)
print(json.dumps({"stats": stats, "wall_ns": wall_ns, "after_reset": _internal.thread_pool_stats(),
                  "sha": hashlib.sha256(b"".join(x.tobytes() for x in logits)).hexdigest()}))
"""


def run_child(stats: str) -> dict:
    env = child_env(base={**os.environ, "SHARPI_POOL_STATS": stats})
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def on_and_off():
    return run_child("1"), run_child("0")


def test_counters_are_consistent_when_on(on_and_off):
    on, _ = on_and_off
    st = on["stats"]
    assert st["regions"] > 0 and st["inline_regions"] > 0, st
    assert st["thread_slots"] == 2 * st["regions"], st
    assert st["region_ns"] <= on["wall_ns"], (st, on["wall_ns"])
    assert 0 < st["busy_ns"] <= 2 * st["region_ns"] + 10_000 * st["regions"], st  # + a clock read per chunk
    assert st["caller_wait_ns"] <= st["region_ns"], st
    assert st["workers_late"] <= st["workers_joined"] <= st["regions"], st
    if st["workers_joined"]:
        assert st["wake_ns"] > 0, st
    assert all(v == 0 for v in on["after_reset"].values()), on["after_reset"]


def test_counters_stay_zero_when_off_and_change_no_bit(on_and_off):
    on, off = on_and_off
    assert all(v == 0 for v in off["stats"].values()), off["stats"]
    assert on["sha"] == off["sha"]
