#!/usr/bin/env python3
"""Memory and decode speed at long context, per KV cache type, sharpi beside llama.cpp (issue 14).

    PYTHONPATH=python python benchmarks/long_context.py /work/models/qwen3-30b-a3b-q4_k_m.gguf \\
        --n-ctx 4096 --kv-types f32,f16,q8_0 --plan-ctx 4096,32768 --out bench-out/long_context

Per KV type (the same type for K and V, llama.cpp's names):
  memory   sharpi: the minimum RAM budget of a streaming session (`_internal.memory_plan`: dense weights +
           KV cache + buffers + the fewest expert slots a layer needs) and the KV bytes, at every
           --plan-ctx. llama.cpp: what it allocates beside the mapped weights, read from its own log
           (`KV buffer size`, `compute buffer size`, `output buffer size`) after creating a context
           of that size with n_ubatch 512 (its default) and a 512-token prompt (fewer below 520 context); its weights stay
           mapped (the whole file must be in memory for full speed, so the file size is beside them).
  speed    one fresh process per engine and type, engines alternating: an untimed 32-token warm-up,
           then a prompt that fills the context to --n-ctx less the decode steps (timed: prefill
           tok/s), then --segments runs of --decode greedy steps (decode tok/s = their median).
           Everything resident (no budget): the KV type's cost is attention over a long context.

Writes OUT/long_context.md and OUT/long_context.json; engine logs in OUT/logs/.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, os.fspath(HERE))

import compare

MIB = 1 << 20
# The lines of llama.cpp's log that name memory it allocates beside the mapped weights.
LLAMA_BUFFER_LINE = re.compile(r"CPU\s+(KV|compute|output|RS) buffer size\s*=\s*([0-9.]+) MiB")


def llama_buffers_mib(log_path) -> dict:
    """{"KV": MiB, "compute": MiB, "output": MiB, ...} summed over the log's buffer lines."""
    out: dict = {}
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return out
    for kind, mib in LLAMA_BUFFER_LINE.findall(text):
        out[kind] = out.get(kind, 0.0) + float(mib)
    return out


def sharpi_plans(path, types: list, contexts: list) -> dict:
    from sharpi import _internal

    plans = {}
    for t in types:
        for n_ctx in contexts:
            p = _internal.memory_plan(os.fspath(path), n_ctx, t, t, allow_long_context=True)
            plans[f"{t}@{n_ctx}"] = {k: p[k] for k in ("minimum_bytes", "kv_bytes", "dense_bytes", "buffer_bytes",
                                                      "slot_bytes", "n_min_slots")}
    return plans


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--n-ctx", type=int, default=4096, help="context of the speed runs (default 4096)")
    ap.add_argument("--kv-types", default="f32,f16,q8_0")
    ap.add_argument("--plan-ctx", default="4096,32768", help="contexts of the memory columns")
    ap.add_argument("--decode", type=int, default=16, help="greedy steps per decode segment")
    ap.add_argument("--segments", type=int, default=3, help="decode segments after the one prefill (median)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default="sharpi,llama.cpp")
    ap.add_argument("--llama-no-repack", action="store_true")
    ap.add_argument("--speed-engines", default=None,
                    help="engines of the speed runs (default: --engines; llama.cpp's memory runs need no prefill "
                    "of the whole context, its speed runs do)")
    ap.add_argument("--skip-speed", action="store_true", help="memory columns only")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default="bench-out/long_context")
    return ap


def make_runner(name: str, args, n_ctx: int, log_dir: Path, kv: str, segments: int):
    kw = {"threads": args.threads, "n_ctx": n_ctx, "log_dir": log_dir, "timeout_s": args.timeout, "kv_type": kv,
              "decode_segments": segments}
    if name == "sharpi":
        return compare.SharpiRunner(**kw)
    if name == "llama.cpp":
        return compare.LlamaCppRunner(no_repack=args.llama_no_repack, **kw)
    raise SystemExit(f"unknown engine {name!r} (sharpi, llama.cpp)")


def render(report: dict) -> str:
    types, contexts = report["kv_types"], report["plan_ctx"]
    lines = [f"# Long context per KV type — {Path(report['file']).name}, {report['threads']} threads",
             "",
             (f"file {report['file_bytes'] / MIB:,.0f} MiB; load average {report['load_start']:.2f} at start, "
             f"{report['load_end']:.2f} at end; speed runs at n_ctx {report['n_ctx']} "
             f"(prompt {report['n_prompt']} tokens, then {report['segments']} × {report['decode']} decode steps)"),
             "",
             "## Memory (MiB)",
             "",
             ("| KV type | context | sharpi KV | sharpi minimum budget | llama.cpp KV | llama.cpp compute + output |"
             " llama.cpp total beside its mapped weights |"),
             "|---|---|---|---|---|---|---|"]
    for t in types:
        for n_ctx in contexts:
            p = report["plans"][f"{t}@{n_ctx}"]
            lm = report["llama_memory"].get(f"{t}@{n_ctx}", {})
            if lm.get("status") == compare.STATUS_OK:
                b = lm["buffers_mib"]
                other = b.get("compute", 0.0) + b.get("output", 0.0)
                cells = f"{b.get('KV', 0.0):,.0f} | {other:,.0f} | {b.get('KV', 0.0) + other:,.0f}"
            else:
                cells = " | ".join([lm.get("status", "not run")] * 3)
            lines.append(f"| {t} | {n_ctx} | {p['kv_bytes'] / MIB:,.0f} | {p['minimum_bytes'] / MIB:,.0f} | {cells} |")
    lines += ["", f"## Speed at n_ctx {report['n_ctx']} (tok/s; decode = median of the segments)", "",
              "| KV type | engine | prefill | decode | decode segments | peak RSS MiB |", "|---|---|---|---|---|---|"]
    for row in report["speed"]:
        r = row["result"]
        if r.get("status") == compare.STATUS_OK:
            segs = ", ".join(f"{v:.2f}" for v in r.get("segment_decode_tok_s", []))
            rss = r.get("memory", {}).get("VmHWM", 0) / MIB
            lines.append(f"| {row['kv']} | {row['engine']} | {r['prefill_tok_s']:.2f} | {r['decode_tok_s']:.2f} | "
                         f"{segs} | {rss:,.0f} |")
        else:
            lines.append(f"| {row['kv']} | {row['engine']} | {r.get('status')}: {r.get('reason', '')[:120]} | | | |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    path = Path(args.file).resolve()
    out = Path(args.out)
    log_dir = out / "logs"
    out.mkdir(parents=True, exist_ok=True)
    types = args.kv_types.split(",")
    contexts = [int(c) for c in args.plan_ctx.split(",")]
    engines = args.engines.split(",")
    n_prompt = args.n_ctx - args.decode * args.segments - 8
    # The memory runs' prompt sets llama.cpp's n_ubatch (compare's runner: n_batch = n_ubatch = prompt):
    # 512, its default, unless a context is smaller.
    n_mem_prompt = min(512, min(contexts) - 8)
    prompts, source = compare.prompt_ids_for(path, [n_prompt, n_mem_prompt])
    report = {"file": os.fspath(path), "file_bytes": path.stat().st_size, "threads": args.threads,
              "kv_types": types, "plan_ctx": contexts, "n_ctx": args.n_ctx, "n_prompt": n_prompt,
              "decode": args.decode, "segments": args.segments, "prompt_source": source,
              "load_start": os.getloadavg()[0], "argv": sys.argv[1:]}
    report["plans"] = sharpi_plans(path, types, contexts)
    compare.warm_page_cache(path)
    report["llama_memory"] = {}
    if "llama.cpp" in engines:
        for t in types:
            for n_ctx in contexts:
                r = make_runner("llama.cpp", args, n_ctx, log_dir, t, 1).measure(path, prompts[n_mem_prompt], 1,
                                                                                 tag=f"mem-{t}-{n_ctx}")
                if r.get("status") == compare.STATUS_OK:
                    r["buffers_mib"] = llama_buffers_mib(r["log"])
                report["llama_memory"][f"{t}@{n_ctx}"] = {k: v for k, v in r.items() if k != "tokens"}
                print(f"long_context: llama.cpp memory {t}@{n_ctx}: {r.get('buffers_mib', r.get('reason'))}",
                      flush=True)
    report["speed"] = []
    if not args.skip_speed:
        for t in types:
            for name in (args.speed_engines or args.engines).split(","):
                r = make_runner(name, args, args.n_ctx, log_dir, t, args.segments).measure(
                    path, prompts[n_prompt], args.decode, tag=f"speed-{t}")
                report["speed"].append({"kv": t, "engine": name, "result": {k: v for k, v in r.items()
                                                                            if k != "tokens"}})
                print(f"long_context: {name} {t}: prefill {r.get('prefill_tok_s')} decode {r.get('decode_tok_s')} "
                      f"{r.get('reason', '')}", flush=True)
    report["load_end"] = os.getloadavg()[0]
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    (out / "long_context.json").write_text(json.dumps(report, indent=1))
    (out / "long_context.md").write_text(render(report))
    print(render(report))
    return 0


if __name__ == "__main__":  # the engines' workers run compare.py --worker
    sys.exit(main())
