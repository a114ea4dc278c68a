#!/usr/bin/env python3
"""What the thread pool's wake-ups and barriers cost a decoded token (issue 12: keep it under 5% of TPOT on
the tiny models).

Method. Built with SHARPI_POOL_STATS=1, every pool times its parallel regions (threads/thread_pool.h,
ThreadPoolStats): a region runs from parallel_for publishing its job to parallel_for returning; inside it,
each thread's time in bodies is its work. Per decoded token the script reports
  regions       parallel_for calls handed to the workers (and those run inline, below the size floor),
  wake          mean time from publishing a job to a worker joining it (spin hit or futex wake-up), and
                its sum per token (the workers' time, an upper bound on its share of the critical path),
  barrier       the caller's time from finishing its own last chunk to returning: waiting for the
                workers, on the critical path,
  lost          region wall time - work / n_threads, summed: the wall time a token would save if every
                region split its work perfectly with no wake-up and no barrier (wake-up latency, the
                barrier, and load imbalance together; an upper bound on what a cheaper pool could win),
and each as a percentage of TPOT. Timing itself costs two clock reads per chunk; the script also decodes
with the counters off and with one thread, alternating (on, off, one thread), so that cost is visible as
the TPOT difference and the pool's net gain as the 1-thread column.

Each configuration runs in its own process (the pool reads SHARPI_POOL_STATS when it is built), all with
the same prompt, greedy decoding, median of --repeats runs. Time it under the bench lock with the
processes under SCHED_FIFO, as every timed run on these shared machines:

    flock /work/locks/bench.lock chrt -f 10 python benchmarks/bench_threadpool.py --out bench-out/threadpool \\
        --models stdlib-moe,/work/models/olmoe-1b-7b-q4_k_m.gguf,/work/models/olmoe-1b-7b-q8_0.gguf
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time


def run_one(path: str, threads: int, n_prompt: int, n_decode: int) -> dict:
    """One process: prefill, two untimed decode steps, then n_decode timed greedy steps."""
    import numpy as np
    import sharpi
    from sharpi import _internal

    s = sharpi.Session(path, threads=threads, n_ctx=n_prompt + n_decode + 8)
    prompt = [1 + (7 * i) % 100 for i in range(n_prompt)]
    token = int(np.argmax(s.decode(prompt)))
    for _ in range(2):
        token = int(np.argmax(s.decode([token])))
    _internal.thread_pool_stats(reset=True)
    tokens, logits = [], []
    t0 = time.perf_counter()
    for _ in range(n_decode):
        logits.append(s.decode([token]))
        token = int(np.argmax(logits[-1]))
        tokens.append(token)
    elapsed = time.perf_counter() - t0
    st = _internal.thread_pool_stats(reset=True)
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(x).tobytes() for x in logits)).hexdigest()
    return {
        "tpot_ms": 1e3 * elapsed / n_decode,
        "tokens": tokens,
        "logits_sha256": digest,
        "stats": st,
        "n_decode": n_decode,
    }


def per_token(r: dict, threads: int) -> dict:
    st, n = r["stats"], r["n_decode"]
    tpot_us = r["tpot_ms"] * 1e3
    lost_us = (st["region_ns"] - st["busy_ns"] / threads) / 1e3 / n
    region_us = st["region_ns"] / 1e3 / n
    barrier_us = st["caller_wait_ns"] / 1e3 / n
    joined = st["workers_joined"]
    return {
        "tpot_ms": r["tpot_ms"],
        "regions": st["regions"] / n,
        "inline_regions": st["inline_regions"] / n,
        "region_us": region_us,
        "wake_us_mean": st["wake_ns"] / 1e3 / joined if joined else float("nan"),
        "joined_per_region": joined / st["regions"] if st["regions"] else float("nan"),
        "late_workers": st["workers_late"] / n,
        "missed_workers": st["workers_missed"] / n,
        "worker_sleeps": st["worker_sleeps"] / n,
        "wake_pct": 100 * st["wake_ns"] / 1e3 / n / tpot_us,
        "barrier_us": barrier_us,
        "lost_us": lost_us,
        "region_pct": 100 * region_us / tpot_us,
        "barrier_pct": 100 * barrier_us / tpot_us,
        "lost_pct": 100 * lost_us / tpot_us,
    }


def spawn(
    path: str, threads: int, n_prompt: int, n_decode: int, stats: bool, pythonpath: str | None = None
) -> dict:
    env = dict(os.environ)
    env["SHARPI_POOL_STATS"] = "1" if stats else "0"
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cmd = [
        sys.executable,
        __file__,
        "--child",
        path,
        "--threads",
        str(threads),
        "--prompt",
        str(n_prompt),
        "--decode",
        str(n_decode),
    ]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def resolve(model: str) -> str:
    if model == "stdlib-moe":
        from sharpi.models import default_model_path

        return str(default_model_path())
    return model


HEADER = (
    "| model | TPOT ms 1 thread | TPOT ms (counters off) | TPOT ms (on) | regions/token (+inline) | "
    "workers joined/region | wake µs (mean) | wake % of TPOT | barrier µs/token | barrier % of TPOT | "
    "lost µs/token | lost % of TPOT |"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-out/threadpool", help="folder for the table and the JSON")
    ap.add_argument(
        "--models",
        default="stdlib-moe,/work/models/olmoe-1b-7b-q4_k_m.gguf",
        help="comma-separated GGUF paths; stdlib-moe is the shipped model",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--baseline",
        help="PYTHONPATH of another sharpi build (with thread_pool_stats): its rows "
        "run alternating with this build's, and its logits must be bit-identical",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_one(args.child, args.threads, args.prompt, args.decode)))
        return

    results = {}
    lines = [
        (
            f"{args.threads} threads, prompt {args.prompt}, {args.decode} decoded tokens, median of {args.repeats} "
            "(counters on, off and 1 thread alternating"
            + (", this build and the baseline" if args.baseline else "")
            + ", one process each)"
        ),
        "",
        HEADER,
        "|---" * HEADER.count(" | ") + "|---|",
    ]
    builds = [("", None)] + ([(" (baseline)", args.baseline)] if args.baseline else [])
    for model in args.models.split(","):
        path = resolve(model)
        runs = {name: {"on": [], "off": [], "one": []} for name, _ in builds}
        spawn(path, args.threads, args.prompt, 4, stats=False)  # untimed: page cache equally warm for all
        for _ in range(args.repeats):
            for name, pp in builds:
                runs[name]["on"].append(spawn(path, args.threads, args.prompt, args.decode, True, pp))
                runs[name]["off"].append(spawn(path, args.threads, args.prompt, args.decode, False, pp))
                runs[name]["one"].append(spawn(path, 1, args.prompt, args.decode, False, pp))
        every = [r for name, _ in builds for kind in ("on", "off", "one") for r in runs[name][kind]]
        if any(r["logits_sha256"] != every[0]["logits_sha256"] for r in every):
            raise SystemExit(f"{model}: the build, thread count or counters changed the logits")
        results[model] = {}
        for name, _ in builds:
            rows = [per_token(r, args.threads) for r in runs[name]["on"]]

            def med(key, rows=rows):
                return statistics.median(r[key] for r in rows)

            tpot_off = statistics.median(r["tpot_ms"] for r in runs[name]["off"])
            tpot_one = statistics.median(r["tpot_ms"] for r in runs[name]["one"])
            results[model][name.strip() or "this build"] = {
                "on": rows,
                "off_tpot_ms": [r["tpot_ms"] for r in runs[name]["off"]],
                "one_thread_tpot_ms": [r["tpot_ms"] for r in runs[name]["one"]],
            }
            lines.append(
                f"| {os.path.basename(path)}{name} | {tpot_one:.2f} | {tpot_off:.2f} | {med('tpot_ms'):.2f} | "
                f"{med('regions'):.0f} (+{med('inline_regions'):.0f}) | {med('joined_per_region'):.2f} | "
                f"{med('wake_us_mean'):.1f} | {med('wake_pct'):.1f} | {med('barrier_us'):.0f} | "
                f"{med('barrier_pct'):.1f} | {med('lost_us'):.0f} | {med('lost_pct'):.1f} |"
            )
            print(lines[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "threadpool.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "threadpool.json"), "w") as fh:
        json.dump({"args": vars(args), "results": results}, fh, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
