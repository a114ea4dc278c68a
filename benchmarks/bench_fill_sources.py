#!/usr/bin/env python3
"""Read bandwidth of the VRAM tier's fill sources beside the RAM tier's io_uring reader, on one file
(issue 22: the cuFile reader beside io_uring + copy).

    PYTHONPATH=python python benchmarks/bench_fill_sources.py FILE.gguf --vram-budget 4GiB \\
        --ram-budget 8GiB --tokens 24 --out bench-out/fill.json

Each source serves the same streamed decode (the same token ids, one token per step, so every step's
misses are reads): a fresh Session per source and round, sources alternating, --repeats rounds.
Per run: the bytes its reader delivered, the time the reader was busy (io_busy_ms: some read
outstanding), their ratio (the source's bandwidth under this demand), and decode tok/s.
  cuda copy  device="cuda", vram_budget: cudaMemcpyAsync from the model's mapping, pinned (so the
             bytes come from RAM: the mapping is faulted in and locked when the session opens);
  cufile     the same with reader="cufile": cuFileReadAsync from the file into the slots (GPUDirect
             Storage, or cuFile's compatibility mode, which the stats' reader_detail names);
  io_uring   device="cpu", ram_budget, reader="io_uring": O_DIRECT reads into host slots (the host tier
             of a GPU run; the copy to VRAM would follow).
O_DIRECT reads bypass the page cache, so cufile (O_DIRECT where allowed) and io_uring read the disk.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

SOURCES = {
    "cuda copy": {"device": "cuda", "reader": "io_uring"},
    "cufile": {"device": "cuda", "reader": "cufile"},
    "io_uring": {"device": "cpu", "reader": "io_uring"},
}


def one_run(path: str, source: str, args, ids: list) -> dict:
    import sharpi

    o = SOURCES[source]
    budget = {"vram_budget": args.vram_budget} if o["device"] == "cuda" else {"ram_budget": args.ram_budget}
    t0 = time.perf_counter()
    s = sharpi.Session(path, device=o["device"], reader=o["reader"], threads=args.threads, n_ctx=256, **budget)
    open_s = time.perf_counter() - t0
    s.decode(ids[:1])
    s.reset_stats()
    t1 = time.perf_counter()
    for t in ids[1:]:
        s.decode([t])
    wall = time.perf_counter() - t1
    st = s.expert_stats()
    read = sum(x["bytes_read"] for x in st["layers"])
    busy_ms = st["io_busy_ms"]
    return {"source": source, "reader": st["reader"], "reader_detail": st["reader_detail"],
            "reader_note": st["reader_note"], "open_s": open_s, "bytes_read": read, "io_busy_ms": busy_ms,
            "gb_per_s": read / (busy_ms * 1e6) if busy_ms else None,
            "decode_tok_s": (len(ids) - 1) / wall,
            "stall_ms": sum(x["stall_ms"] for x in st["layers"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--vram-budget", default="4GiB")
    ap.add_argument("--ram-budget", default="8GiB")
    ap.add_argument("--sources", default=",".join(SOURCES))
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON of every run")
    args = ap.parse_args(argv)
    import numpy as np
    import sharpi

    ids = [int(t) for t in np.random.default_rng(3).integers(1, 1000, size=args.tokens)]
    sources = [x.strip() for x in args.sources.split(",") if x.strip()]
    runs = {src: [] for src in sources}
    for rep in range(args.repeats):
        for src in sources:
            try:
                r = one_run(args.file, src, args, ids)
            except sharpi.SharpiError as e:  # a source that cannot run here is a row that says why
                r = {"source": src, "error": f"{type(e).__name__}: {e}"}
            runs[src].append(r)
            print(f"fill: round {rep + 1} {src}: " + (r.get("error") or
                  f"{r['gb_per_s']:.2f} GB/s busy, {r['bytes_read'] / 1e9:.2f} GB, {r['decode_tok_s']:.2f} tok/s"),
                  file=sys.stderr)
    print("| source | reader | GB/s while busy (median) | GB read | decode tok/s | stall ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for src, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            print(f"| {src} | - | {rs[0]['error']} | | | |")
            continue
        med = statistics.median
        print(f"| {src} | {ok[0]['reader']} | {med(r['gb_per_s'] for r in ok):.2f} | "
              f"{med(r['bytes_read'] for r in ok) / 1e9:.2f} | {med(r['decode_tok_s'] for r in ok):.2f} | "
              f"{med(r['stall_ms'] for r in ok):.0f} |")
    for src, rs in runs.items():
        if rs and "reader_detail" in rs[0]:
            print(f"- {src}: {rs[0]['reader_detail']}" + (f" ({rs[0]['reader_note']})" if rs[0]["reader_note"] else ""))
    if args.out:
        Path(args.out).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
