#!/usr/bin/env python3
"""Throughput of the expert readers (io_uring + O_DIRECT vs the pread pool) on expert-sized reads.

Reads 1-2 MiB ranges at unaligned offsets, as experts sit in a GGUF file, from a multi-GB file:
  sequential  consecutive ranges through the file (an expert tensor streamed in order),
  random      ranges at random offsets (a cold cache filling after routing),
with every reader configuration, the page cache dropped before each run (`echo 1 >
/proc/sys/vm/drop_caches` as root, else posix_fadvise(DONTNEED) on the file; O_DIRECT bypasses the
cache anyway). GB/s counts the requested bytes only (not the 4 KiB alignment padding). Every run's
bytes are checked against Python's own read of a few sampled ranges before timing counts.

The data file is plain random bytes (--size-gib, default 3), written once to --data-dir and reused;
a GGUF can be given instead with --file (its bytes are as good as any). The table is printed and
the raw numbers written to <out>/bench_readers.json.

    python benchmarks/bench_readers.py --out bench-out/readers [--size-gib 3] [--bytes-gib 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time

import numpy as np
from sharpi import _core, _internal

MiB = 1 << 20
GiB = 1 << 30

CONFIGS = {
    "pread x2": {"kind": "pread", "pread_threads": 2},  # the default pread reader
    "pread x4": {"kind": "pread", "pread_threads": 4},
    "io_uring d16": {"kind": "uring", "queue_depth": 16},  # the default io_uring reader (512 KiB chunks)
    "io_uring d8 c2M": {"kind": "uring", "queue_depth": 8, "chunk_bytes": 2 * MiB},
    "io_uring d32": {"kind": "uring", "queue_depth": 32},
    "io_uring d16 c1M": {"kind": "uring", "queue_depth": 16, "chunk_bytes": 1 * MiB},
    "io_uring d32 c1M": {"kind": "uring", "queue_depth": 32, "chunk_bytes": 1 * MiB},
    "io_uring d64 c1M": {"kind": "uring", "queue_depth": 64, "chunk_bytes": 1 * MiB},
}


def make_data_file(path: str, size: int) -> None:
    if os.path.exists(path) and os.path.getsize(path) == size:
        return
    rng = np.random.default_rng(2024)
    block = 64 * MiB
    t0 = time.perf_counter()
    with open(path + ".tmp", "wb") as f:
        written = 0
        while written < size:
            n = min(block, size - written)
            f.write(rng.bytes(n))
            written += n
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    print(f"wrote {path}: {size / GiB:.2f} GiB in {time.perf_counter() - t0:.1f} s")


def drop_page_cache(path: str) -> str:
    """Empties the page cache of the file; returns how."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return "fadvise"


def workloads(size: int, total: int, seed: int) -> dict[str, list[tuple[int, int, str]]]:
    rng = random.Random(seed)
    sequential, offset, n = [], rng.randrange(4096), 0
    while n < total:
        length = rng.randint(MiB, 2 * MiB)
        if offset + length > size:
            break
        sequential.append((offset, length, "demand"))
        offset += length  # back to back: expert e+1 starts where e ends
        n += length
    random_ranges, n = [], 0
    while n < total:
        length = rng.randint(MiB, 2 * MiB)
        random_ranges.append((rng.randrange(size - length), length, "demand"))
        n += length
    return {"sequential": sequential, "random": random_ranges}


def check_sample(reader, path: str, ranges, rng: random.Random) -> None:
    sample = rng.sample(ranges, min(8, len(ranges)))
    got = reader.read(sample)
    with open(path, "rb") as f:
        for (offset, length, _), blob in zip(sample, got):
            f.seek(offset)
            if f.read(length) != blob:
                raise SystemExit(f"{reader.describe}: wrong bytes at [{offset:#x}, +{length:#x})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-out/readers", help="folder for bench_readers.json")
    ap.add_argument("--file", help="read this file instead of a generated one")
    ap.add_argument("--data-dir", default="/tmp/sharpi-bench", help="where the generated file lives")
    ap.add_argument("--size-gib", type=float, default=3.0, help="size of the generated file")
    ap.add_argument("--bytes-gib", type=float, default=1.0, help="bytes requested per run")
    ap.add_argument("--arena-mib", type=int, default=64, help="arena: bounds the requests queued at once")
    ap.add_argument("--repeats", type=int, default=2, help="runs per cell; the best is reported")
    ap.add_argument(
        "--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS)
    )
    args = ap.parse_args()

    if args.file:
        path = args.file
    else:
        os.makedirs(args.data_dir, exist_ok=True)
        size = int(args.size_gib * GiB) // 4096 * 4096 + 1234  # deliberately not block-aligned
        path = os.path.join(args.data_dir, f"random-{args.size_gib:g}GiB.bin")
        make_data_file(path, size)
    size = os.path.getsize(path)
    loads = workloads(size, int(args.bytes_gib * GiB), seed=7)
    check_rng = random.Random(1)

    results = []
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    for name in names:
        cfg = dict(CONFIGS[name])
        kind = cfg.pop("kind")
        try:
            reader = _internal.ExpertReaderTest(kind, path, arena_bytes=args.arena_mib * MiB, **cfg)
        except _core.UnsupportedError as e:
            print(f"{name}: skipped ({e})")
            continue
        check_sample(reader, path, loads["random"], check_rng)
        for load, ranges in loads.items():
            best = None
            for _ in range(args.repeats):
                how = drop_page_cache(path)
                t0 = time.perf_counter()
                nbytes = reader.read(ranges, keep_bytes=False)
                seconds = time.perf_counter() - t0
                if best is None or seconds < best["seconds"]:
                    best = {"seconds": seconds, "bytes": nbytes, "cache_drop": how}
            results.append(
                {
                    "config": name,
                    "reader": reader.describe,
                    "workload": load,
                    "requests": len(ranges),
                    "bytes": best["bytes"],
                    "seconds": best["seconds"],
                    "gb_per_s": best["bytes"] / best["seconds"] / 1e9,
                    "requests_per_s": len(ranges) / best["seconds"],
                    "cache_drop": best["cache_drop"],
                }
            )
        del reader

    print()
    print(f"file: {path} ({size / GiB:.2f} GiB), {args.bytes_gib:g} GiB of 1-2 MiB unaligned reads per run")
    print(f"{'reader':<16} {'workload':<11} {'GB/s':>7} {'req/s':>8} {'s':>7}  cache")
    for r in results:
        print(
            f"{r['config']:<16} {r['workload']:<11} {r['gb_per_s']:7.2f} {r['requests_per_s']:8.0f} "
            f"{r['seconds']:7.2f}  {r['cache_drop']}"
        )
    for name in names:
        described = next((r["reader"] for r in results if r["config"] == name), None)
        if described:
            print(f"  {name}: {described}")

    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, "bench_readers.json")
    with open(out, "w") as f:
        json.dump(
            {
                "file": path,
                "file_bytes": size,
                "bytes_per_run": int(args.bytes_gib * GiB),
                "arena_bytes": args.arena_mib * MiB,
                "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
                "results": results,
            },
            f,
            indent=2,
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
