"""Throughput of the quantized CPU kernels: decode matmul (dot_row per weight row) over a large
matrix, per type and ISA, on 1 and 2 threads, next to this machine's memory bandwidth.

    PYTHONPATH=python python benchmarks/bench_kernels.py [--mib 64] [--types q4_K,q6_K] [--math fast,exact] [--out DIR]

Decode is memory-bound in principle: every weight byte is read once per token. The table shows
GB/s of weight bytes read (compare with the memcpy line) and Gelem/s (multiply-adds per second:
weights x tokens), for each --math: "fast" (activations quantized once per call, integer dots:
cpu/quant/qdot.h) and "exact" (f32 activations on dequantized weights). Optionally (--prefill T) also prefill throughput for T tokens. Each ISA runs in its own
child process (SHARPI_ISA is fixed per process). Raw numbers go to DIR/bench_kernels.json.

Timing: best of --reps calls after one warm-up call, wall clock. The machines this runs on are
shared, so the load average is recorded with the results, and for one thread the table also
gives GB/s by the calling thread's CPU time, which excludes time the thread spent preempted.
"""

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

TYPE_IDS = {
    "f32": 0, "f16": 1, "bf16": 30, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8,
    "q2_K": 10, "q3_K": 11, "q4_K": 12, "q5_K": 13, "q6_K": 14,
    "iq4_nl": 20, "iq4_xs": 23, "iq3_s": 21, "iq3_xxs": 18, "iq2_s": 22, "iq2_xs": 17, "iq2_xxs": 16,
    "iq1_s": 19, "iq1_m": 29,
}  # fmt: skip
# (elements per block, bytes per block, byte offsets of f16 scale fields)
LAYOUT = {
    "f32": (1, 4, []), "f16": (1, 2, []), "bf16": (1, 2, []),
    "q4_0": (32, 18, [0]), "q4_1": (32, 20, [0, 2]), "q5_0": (32, 22, [0]), "q5_1": (32, 24, [0, 2]),
    "q8_0": (32, 34, [0]), "q2_K": (256, 84, [80, 82]), "q3_K": (256, 110, [108]),
    "q4_K": (256, 144, [0, 2]), "q5_K": (256, 176, [0, 2]), "q6_K": (256, 210, [208]),
    "iq4_nl": (32, 18, [0]), "iq4_xs": (256, 136, [0]), "iq3_s": (256, 110, [0]), "iq3_xxs": (256, 98, [0]),
    "iq2_s": (256, 82, [0]), "iq2_xs": (256, 74, [0]), "iq2_xxs": (256, 66, [0]), "iq1_s": (256, 50, [0]),
    "iq1_m": (256, 56, []),  # d in the top nibbles of the scale words: set in random_matrix
}  # fmt: skip
N_COLS = 4096  # a typical hidden size; a multiple of every block size


def random_matrix(name, n_rows, rng):
    """n_rows x N_COLS of type `name` as raw bytes with sane scales (no NaN/inf)."""
    bs, ts, f16_fields = LAYOUT[name]
    if name == "f32":
        return rng.standard_normal(n_rows * N_COLS, dtype=np.float32).view(np.uint8)
    if name in ("f16", "bf16"):
        f = rng.standard_normal(n_rows * N_COLS, dtype=np.float32)
        h = (
            f.astype(np.float16).view(np.uint16)
            if name == "f16"
            else (f.view(np.uint32) >> 16).astype(np.uint16)
        )
        return h.view(np.uint8)
    n_blocks = n_rows * N_COLS // bs
    raw = rng.integers(0, 256, size=(n_blocks, ts), dtype=np.uint8)
    for off in f16_fields:
        d = rng.uniform(1e-3, 1e-1, size=n_blocks).astype(np.float16)
        raw[:, off : off + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    if name == "iq1_m":  # d = 0x2400 (2^-6), one nibble per uint16 scale word, low nibble first
        words = raw[:, 48:56].view(np.uint16)
        for i in range(4):
            words[:, i] = (words[:, i] & 0x0FFF) | (((0x2400 >> (4 * i)) & 0xF) << 12)
    return raw.reshape(-1)


def best_time(fn, reps, clock=time.perf_counter):
    fn()  # warm-up: page faults, pool start
    best = float("inf")
    for _ in range(reps):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def worker(args):
    from sharpi import _internal

    rng = np.random.default_rng(0)
    results = []
    for name in args.types:
        bs, ts, _ = LAYOUT[name]
        row_bytes = N_COLS // bs * ts
        n_rows = max(1, int(args.mib * 2**20) // row_bytes)
        data = random_matrix(name, n_rows, rng)
        x1 = rng.standard_normal((1, N_COLS), dtype=np.float32)
        for threads, math in [(t, m) for m in args.math for t in args.threads]:
            exact = math == "exact"
            run = functools.partial(
                _internal.matmul, TYPE_IDS[name], data, n_rows, N_COLS, x1, threads=threads, exact=exact
            )
            t = best_time(run, args.reps)
            entry = {
                "type": name, "isa": _internal.active_isa(), "math": math, "threads": threads, "mode": "decode", "tokens": 1,
                "weight_bytes": data.size, "n_rows": n_rows, "n_cols": N_COLS, "multiply_adds": n_rows * N_COLS, "seconds": t,
                "weight_gbps": data.size / t / 1e9, "gelem_per_s": n_rows * N_COLS / t / 1e9,
            }  # fmt: skip
            if threads == 1:
                # One thread runs on the calling thread: its CPU time excludes time lost to other
                # processes on a shared machine (not their memory traffic).
                t_cpu = best_time(run, args.reps, clock=time.thread_time)
                entry["cpu_seconds"] = t_cpu
                entry["cpu_weight_gbps"] = data.size / t_cpu / 1e9
                entry["cpu_gelem_per_s"] = n_rows * N_COLS / t_cpu / 1e9
            results.append(entry)
            if args.prefill:
                # Prefill on a slice that keeps each run short: per token it is compute-bound.
                rows = max(1, n_rows // 16)
                xs = rng.standard_normal((args.prefill, N_COLS), dtype=np.float32)
                part = data[: rows * row_bytes]
                run = functools.partial(
                    _internal.matmul, TYPE_IDS[name], part, rows, N_COLS, xs, threads=threads, exact=exact
                )
                t = best_time(run, args.reps)
                pf = {**entry, "mode": "prefill", "tokens": args.prefill, "weight_bytes": part.size, "n_rows": rows,
                      "multiply_adds": rows * N_COLS * args.prefill, "seconds": t, "weight_gbps": part.size / t / 1e9,
                      "gelem_per_s": rows * N_COLS * args.prefill / t / 1e9}  # fmt: skip
                for key in ("cpu_seconds", "cpu_weight_gbps", "cpu_gelem_per_s"):
                    pf.pop(key, None)
                if threads == 1:
                    t_cpu = best_time(run, args.reps, clock=time.thread_time)
                    pf["cpu_seconds"] = t_cpu
                    pf["cpu_weight_gbps"] = part.size / t_cpu / 1e9
                    pf["cpu_gelem_per_s"] = rows * N_COLS * args.prefill / t_cpu / 1e9
                results.append(pf)
    json.dump(results, sys.stdout)


def memcpy_gbps(mib=512, reps=3):
    """numpy copy of a `mib` MiB array: array bytes per second (each byte is read and written)."""
    src = np.ones(mib * 2**20 // 8)
    dst = np.empty_like(src)
    t = best_time(lambda: np.copyto(dst, src), reps)
    return src.nbytes / t / 1e9


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=float, default=64, help="weight matrix size per type (MiB)")
    p.add_argument("--types", default=",".join(TYPE_IDS), help="comma-separated type names")
    p.add_argument("--isas", default="", help="comma-separated ISAs (default: all available)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--math", default="fast,exact", help="comma-separated: fast, exact")
    p.add_argument("--prefill", type=int, default=0, help="also time prefill with this many tokens")
    p.add_argument("--out", default="bench-out/kernels", help="folder for bench_kernels.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.types = [t for t in args.types.split(",") if t]
    args.threads = [int(t) for t in args.threads.split(",") if t]
    args.math = [m for m in args.math.split(",") if m]
    if any(m not in ("fast", "exact") for m in args.math):
        p.error(f"--math takes fast and/or exact, got {args.math}")
    unknown = [t for t in args.types if t not in TYPE_IDS]
    if unknown:
        p.error(f"unknown types {unknown}; known: {list(TYPE_IDS)}")
    if args.worker:
        worker(args)
        return

    from sharpi import _internal

    isas = [i for i in args.isas.split(",") if i] or _internal.isa_available()
    copy_gbps = memcpy_gbps()
    rows = []
    for isa in isas:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--mib", str(args.mib), "--types",
               ",".join(args.types), "--threads", ",".join(map(str, args.threads)), "--reps", str(args.reps),
               "--prefill", str(args.prefill), "--math", ",".join(args.math)]  # fmt: skip
        out = subprocess.run(
            cmd, env={**os.environ, "SHARPI_ISA": isa}, capture_output=True, text=True, check=False
        )
        if out.returncode != 0:
            sys.exit(f"worker for {isa} failed:\n{out.stderr}")
        rows += json.loads(out.stdout)

    print(
        f"memcpy (numpy copy, 512 MiB): {copy_gbps:.1f} GB/s of array bytes ({2 * copy_gbps:.1f} GB/s read+write)"
    )
    print(f"weights: {args.mib:g} MiB per type, {N_COLS} columns; load average {os.getloadavg()[0]:.2f}")
    header = f"{'type':6} {'isa':7} {'math':5} {'mode':8}"
    for t in args.threads:
        header += f" | {t}T GB/s  Gelem/s"
    header += " | 1T by CPU time: GB/s  Gelem/s"
    print(header)
    print("-" * len(header))
    for mode in ("decode", "prefill"):
        for name in args.types:
            for isa, math in [(i, m) for i in isas for m in args.math]:
                sel = {
                    r["threads"]: r
                    for r in rows
                    if r["type"] == name and r["isa"] == isa and r["mode"] == mode and r["math"] == math
                }
                if not sel:
                    continue
                line = f"{name:6} {isa:7} {math:5} {mode if mode == 'decode' else f'pf T={args.prefill}':8}"
                for t in args.threads:
                    line += f" | {sel[t]['weight_gbps']:7.2f}  {sel[t]['gelem_per_s']:7.2f}"
                if 1 in sel and "cpu_seconds" in sel[1]:
                    r = sel[1]
                    line += f" | {r['cpu_weight_gbps']:12.2f}  {r['cpu_gelem_per_s']:7.2f}"
                print(line)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_kernels.json")
    with open(path, "w") as f:
        json.dump(
            {"memcpy_gbps": copy_gbps, "mib": args.mib, "n_cols": N_COLS, "loadavg": os.getloadavg(),
             "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(), "results": rows},
            f, indent=1,
        )  # fmt: skip
    print(f"raw numbers: {path}")


if __name__ == "__main__":
    main()
