"""Soak benchmark (issue 15, not in CI): one streamed session serves request after request and its
memory must stay flat and inside the budget.

A child process (so nothing of this script's own probing counts) opens the model under a RAM budget
of the dense weights, KV cache and buffers plus a share (default 25%) of all expert bytes, with a
predictor, then runs requests of at most --max-request generated tokens each, reset() between them,
until --total-tokens are generated. After every request it records VmHWM (peak RSS) and VmRSS from
/proc/self/status. Checks:
  peak:  VmHWM <= budget + VmHWM of a bare `import sharpi` process + 64 MiB (--slack-mib);
  flat:  VmHWM after the last request - VmHWM after the first <= --flat-mib (default 16 MiB), and
         the same for VmRSS.
Prints a table, writes soak.json into --out, exits 1 if a check fails.

    python benchmarks/soak.py --model /work/models/olmoe-1b-7b-q4_k_m.gguf --out soak-out
    python benchmarks/soak.py --model M --total-tokens 2000 --max-request 400   # a shortened run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MIB = 2**20
PROMPTS = [
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Explain, step by step and in detail, how a compiler turns source code into machine code.",
    "Describe the history of the printing press and its effects on European society.",
    "List and discuss the trade-offs between different database indexing strategies.",
    "Tell the tale of a long voyage across an unknown ocean, day by day.",
]


def proc_status() -> dict:
    """VmHWM and VmRSS of this process in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    return out


def bare_import_peak() -> int:
    """VmHWM of a process that only imports sharpi (the interpreter, numpy, the extension)."""
    code = "import sharpi; print(open('/proc/self/status').read())"
    r = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def plan(model: str, n_ctx: int, predictor: str, share: float) -> dict:
    """The budget: fixed bytes (dense, KV cache, buffers) + share of every expert's slot."""
    import sharpi

    s = sharpi.Session(model, threads=1, n_ctx=n_ctx, ram_budget="1TiB", predictor=predictor)
    st, info = s.expert_stats(), s.info
    total = info["n_layer"] * info["n_expert"]
    return {"budget": st["fixed_bytes"] + int(share * total * st["slot_bytes"]), "fixed": st["fixed_bytes"],
            "slot_bytes": st["slot_bytes"], "n_experts_total": total}


def child(args) -> None:
    """Runs the requests; one JSON line per request on stdout."""
    import sharpi

    s = sharpi.Session(args.model, threads=args.threads, n_ctx=args.n_ctx, ram_budget=args.budget,
                       predictor=args.predictor)
    st = s.expert_stats()
    print(json.dumps({"start": proc_status(), "n_slots": st["n_slots"], "n_staging": st["n_staging"]}), flush=True)
    done, i = 0, 0
    while done < args.total_tokens:
        want = min(args.max_request, args.total_tokens - done)
        s.reset()
        s.reset_stats()
        t0 = time.perf_counter()
        text = "".join(s.generate(PROMPTS[i % len(PROMPTS)], max_tokens=want, temperature=0.8, seed=i,
                                  stop_at_eos=False))
        dt = time.perf_counter() - t0
        n = s.last_stats["n_generated"]
        st = s.expert_stats()
        acc = sum(layer["accesses"] for layer in st["layers"])
        hits = sum(layer["hits"] for layer in st["layers"])
        done += n
        print(json.dumps({"request": i, "tokens": n, "seconds": dt, "decode_tok_s": s.last_stats["decode_tok_s"],
                          "hit_rate": hits / acc if acc else 0.0, "chars": len(text), **proc_status()}),
              flush=True)
        i += 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--share", type=float, default=0.25, help="share of all expert bytes the budget holds")
    p.add_argument("--predictor", default="next_gate")
    p.add_argument("--total-tokens", type=int, default=10000)
    p.add_argument("--max-request", type=int, default=2000)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--slack-mib", type=int, default=64)
    p.add_argument("--flat-mib", type=int, default=16)
    p.add_argument("--out", default="soak-out")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--n-ctx", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0

    n_ctx = args.max_request + 64  # the longest request plus its prompt
    base = bare_import_peak()
    pl = plan(args.model, n_ctx, args.predictor, args.share)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", args.model, "--budget", str(pl["budget"]),
           "--n-ctx", str(n_ctx), "--predictor", args.predictor, "--total-tokens", str(args.total_tokens),
           "--max-request", str(args.max_request), "--threads", str(args.threads)]
    print(f"soak: {args.model}\n  budget {pl['budget'] / MIB:.0f} MiB = fixed {pl['fixed'] / MIB:.0f} MiB + "
          f"{args.share:.0%} of {pl['n_experts_total']} experts x {pl['slot_bytes'] / MIB:.2f} MiB; "
          f"bare import peak {base / MIB:.0f} MiB; predictor {args.predictor}; n_ctx {n_ctx}", flush=True)
    print(f"{'req':>4} {'tokens':>6} {'s':>7} {'tok/s':>6} {'hit':>5} {'VmHWM MiB':>10} {'VmRSS MiB':>10}", flush=True)
    rows, start = [], None
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        for line in proc.stdout:
            r = json.loads(line)
            if "start" in r:
                start = r
                continue
            rows.append(r)
            print(f"{r['request']:>4} {r['tokens']:>6} {r['seconds']:>7.1f} {r['decode_tok_s']:>6.2f} "
                  f"{r['hit_rate']:>5.2f} {r['VmHWM'] / MIB:>10.1f} {r['VmRSS'] / MIB:>10.1f}", flush=True)
    if proc.returncode != 0 or not rows:
        print(f"soak: the child failed (status {proc.returncode})", file=sys.stderr)
        return 1
    limit = pl["budget"] + base + args.slack_mib * MIB
    peak = max(r["VmHWM"] for r in rows)
    hwm_growth = rows[-1]["VmHWM"] - rows[0]["VmHWM"]
    rss_growth = rows[-1]["VmRSS"] - rows[0]["VmRSS"]
    checks = {
        "peak_within_limit": peak <= limit,
        "hwm_flat": hwm_growth <= args.flat_mib * MIB,
        "rss_flat": rss_growth <= args.flat_mib * MIB,
    }
    summary = {"model": args.model, "budget": pl["budget"], "fixed": pl["fixed"], "bare_import_peak": base,
               "limit": limit, "peak": peak, "hwm_growth": hwm_growth, "rss_growth": rss_growth,
               "tokens": sum(r["tokens"] for r in rows), "predictor": args.predictor, "share": args.share,
               "start": start, "requests": rows, "checks": checks}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "soak.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"peak VmHWM {peak / MIB:.1f} MiB, limit {limit / MIB:.1f} MiB (budget + bare import + "
          f"{args.slack_mib} MiB); first->last VmHWM {hwm_growth / MIB:+.1f} MiB, VmRSS {rss_growth / MIB:+.1f} MiB; "
          f"{summary['tokens']} tokens")
    for name, ok in checks.items():
        print(f"  {name}: {'ok' if ok else 'FAIL'}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
