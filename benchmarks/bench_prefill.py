"""Prefill under a RAM budget vs resident: time of one N-token prompt (one decode() call), each run in
its own process from a cold page cache (the whole cache dropped as root, else the file's).

    PYTHONPATH=python python benchmarks/bench_prefill.py -m /work/models/olmoe-1b-7b-q4_k_m.gguf \\
        --tokens 512 --budgets 0.25 --out bench-out/prefill

Budgets are shares of all expert slots (as in `sharpi bench`): RAM budget = fixed bytes + share x
n_layer x n_expert x slot bytes. The resident run maps every expert (page cache, cold at the start,
so it reads the file once too). Prints a table and writes prefill.json beside it. A run that fails is
reported with its error, not dropped. Columns: misses (demand reads), ahead (experts read ahead for
the next layer), used (of those, selected), unique (experts the prompt selected, summed over layers:
reads of used experts = misses + used; each read once when that equals unique).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from sharpi.bench.isolation import drop_page_cache

CHILD = r"""
import json, sys, time
import numpy as np
import sharpi
cfg = json.loads(sys.argv[1])
kw = dict(threads=cfg["threads"], n_ctx=cfg["n_ctx"])
if cfg.get("ram_budget"):
    kw.update(ram_budget=cfg["ram_budget"], reader=cfg["reader"])
t0 = time.perf_counter()
s = sharpi.Session(cfg["model"], **kw)
load_s = time.perf_counter() - t0
rng = np.random.default_rng(cfg["seed"])
prompt = [int(t) for t in rng.integers(1, s.info["n_vocab"], cfg["tokens"])]
t0 = time.perf_counter()
logits = s.decode(prompt)
prefill_s = time.perf_counter() - t0
out = {"load_s": load_s, "prefill_s": prefill_s, "argmax": int(np.argmax(logits))}
if cfg.get("ram_budget"):
    st = s.expert_stats()
    lay = st["layers"]
    out.update(n_slots=st["n_slots"], reader=st["reader"], misses=sum(x["misses"] for x in lay),
               ahead=sum(x["prefetch_issued"] for x in lay), ahead_used=sum(x["prefetch_used"] for x in lay),
               bytes_read=sum(x["bytes_read"] for x in lay), stall_ms=sum(x["stall_ms"] for x in lay),
               selected=sum(len(np.unique(ids)) for ids in s.last_routing()))
print(json.dumps(out))
"""


def probe(model: str, n_ctx: int) -> dict:
    code = (
        "import json, sys, sharpi\n"
        "s = sharpi.Session(sys.argv[1], threads=1, n_ctx=int(sys.argv[2]), ram_budget='1TiB', reader='pread')\n"
        "st = s.expert_stats(); i = s.info\n"
        "print(json.dumps({'fixed': st['fixed_bytes'], 'slot': st['slot_bytes'],"
        " 'total': i['n_layer'] * i['n_expert']}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, model, str(n_ctx)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_one(cfg: dict, drop: str) -> dict:
    how = drop_page_cache([cfg["model"]], drop)
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], check=False, capture_output=True, text=True)
    if p.returncode != 0:
        return {"ok": False, "exit": p.returncode, "error": p.stderr.strip().splitlines()[-1:], "drop": how}
    return {"ok": True, "drop": how, **json.loads(p.stdout.strip().splitlines()[-1])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--budgets", default="0.25", help="shares of all expert slots, comma-separated")
    ap.add_argument("--reader", default="auto", choices=["auto", "uring", "pread"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="rounds; resident and streamed runs alternate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drop-cache", choices=["all", "file"], default="all")
    ap.add_argument("--out", default="bench-out/prefill")
    a = ap.parse_args(argv)
    n_ctx = a.tokens + 16
    shape = probe(a.model, n_ctx)
    shares = [float(x) for x in a.budgets.split(",")]
    base = {"model": a.model, "tokens": a.tokens, "n_ctx": n_ctx, "threads": a.threads, "seed": a.seed}
    rows = []
    for r in range(a.repeat):
        rows.append({"config": "resident", "round": r, **run_one(dict(base), a.drop_cache)})
        for share in shares:
            budget = shape["fixed"] + int(share * shape["total"]) * shape["slot"]
            cfg = dict(base, ram_budget=budget, reader=a.reader)
            rows.append({"config": f"{share:.0%} experts", "round": r, "budget": budget, **run_one(cfg, a.drop_cache)})
    resident = [x["prefill_s"] for x in rows if x["config"] == "resident" and x["ok"]]
    res_best = min(resident) if resident else float("nan")
    lines = [f"prefill of {a.tokens} tokens, {Path(a.model).name}, {a.threads} threads, cache drop: {rows[0]['drop']}",
             (f"{'config':<14} {'round':>5} {'prefill s':>10} {'÷ resident':>10} {'misses':>6} {'ahead':>6} "
              f"{'used':>6} {'unique':>6} {'GiB read':>8} {'stall s':>8}")]
    for x in rows:
        if not x["ok"]:
            lines.append(f"{x['config']:<14} {x['round']:>5} FAILED exit {x['exit']}: {x['error']}")
            continue
        ratio = x["prefill_s"] / res_best
        extra = ""
        if "misses" in x:
            extra = (f" {x['misses']:>6} {x.get('ahead', 0):>6} {x.get('ahead_used', 0):>6} {x['selected']:>6} "
                     f"{x['bytes_read'] / 2**30:>8.2f} {x['stall_ms'] / 1e3:>8.1f}")
        lines.append(f"{x['config']:<14} {x['round']:>5} {x['prefill_s']:>10.2f} {ratio:>10.2f}{extra}")
    text = "\n".join(lines)
    print(text)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill.txt").write_text(text + "\n")
    (out / "prefill.json").write_text(json.dumps({"args": vars(a), "shape": shape, "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
