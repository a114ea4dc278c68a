#!/usr/bin/env python3
"""sharpi and its streaming peers side by side inside one memory cap (issue 13): the memory-capped
mode of benchmarks/compare.py.

    PYTHONPATH=python python benchmarks/compare_capped.py /work/models/qwen3-30b-a3b-q4_k_m.gguf \\
        --cap 5.9GiB --experts-share 0.25 --prompt 32 --decode 4 --repeats 2 --out bench-out/capped

Engines, alternating (A B C A B C ...), each run a fresh worker process inside a fresh cgroup-v1
memory group with memory.limit_in_bytes = --cap (sharpi.bench.isolation.MemoryCap), the whole page
cache dropped before every run (`sync; echo 3 > /proc/sys/vm/drop_caches`, as root; else the
file's pages through posix_fadvise):
  sharpi     Session(ram_budget=...): dense weights, KV cache and buffers, then --experts-share of
             all expert slots (the budget is cut to fit the cap less --sharpi-headroom; the table
             says the share it got);
  llama.cpp  llama-cpp-python, use_mmap, weight repacking off (use_extra_bufts=False) so the
             weights stay in the mapped file instead of being copied into anonymous memory;
  fastllm    ftllm's benchmark (`ftllm benchmark`), --moe_device disk --moe_cpu_cache
             --fastllm-cache (default: the cap less the file's dense bytes less 1.5 GiB for its
             runtime, at least 256 MiB).
The timed part is compare.timed_greedy for sharpi and llama.cpp (a warm-up prompt and step, then the
prompt and --decode greedy steps); fastllm times itself (its warm-up request, then one request of
--prompt tokens of its own tokenizer and --decode + 1 output tokens; TPOT excludes the first token).
A run that fails or is killed by the cap stays in the table with its exit status, the cap, the
group's peak usage, failcnt and OOM kills. Writes OUT/capped.md and OUT/capped.json.

Numbers from a shared 2-core machine are noisy: the load average before each run is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, os.fspath(HERE))
import compare

GiB = 1 << 30
MiB = 1 << 20


class CappedSharpiRunner(compare.SharpiRunner):
    """sharpi streaming its experts under a RAM budget."""

    key = "sharpi_stream"
    label = "sharpi (streamed)"
    worker_script = Path(__file__).resolve()

    def __init__(self, *a, ram_budget: int = 0, reader: str = "auto", predictor: str = "none", **kw):
        super().__init__(*a, **kw)
        self.key, self.label = CappedSharpiRunner.key, CappedSharpiRunner.label
        if predictor != "none":
            self.label += f" + {predictor}"
        self.ram_budget = int(ram_budget)
        self.reader = reader
        self.predictor = predictor

    def options(self) -> dict:
        return {"ram_budget": self.ram_budget, "reader": self.reader, "predictor": self.predictor}

    @classmethod
    def worker_main(cls, spec: dict) -> dict:
        import sharpi

        o = spec["options"]
        t0 = time.perf_counter()
        s = sharpi.Session(spec["file"], threads=spec["threads"], n_ctx=spec["n_ctx"], ram_budget=o["ram_budget"],
                           reader=o["reader"], predictor=o["predictor"])
        load_s = time.perf_counter() - t0

        def bytes_read() -> int:
            return sum(x["bytes_read"] for x in s.expert_stats()["layers"])

        after_prefill = []  # expert bytes read when each prefill returned: the last is the timed one's

        def prefill(ids):
            logits = s.decode(ids)
            after_prefill.append(bytes_read())
            return logits

        r = compare.timed_greedy(prefill, lambda t: s.decode([t]), s.reset, spec["prompt_ids"], spec["n_decode"])
        r["decode_bytes_read"] = bytes_read() - after_prefill[-1]
        st = s.expert_stats()
        lay = st["layers"]
        r.update(load_s=load_s, settings={"threads": spec["threads"], "n_ctx": spec["n_ctx"], **o},
                 expert_stats={"reader": st["reader"], "n_slots": st["n_slots"], "slot_bytes": st["slot_bytes"],
                               "hits": sum(x["hits"] for x in lay), "misses": sum(x["misses"] for x in lay),
                               "bytes_read": sum(x["bytes_read"] for x in lay)})
        return r


class CappedLlamaRunner(compare.LlamaCppRunner):
    worker_script = Path(__file__).resolve()


class FastllmRunner(compare.EngineRunner):
    """fastllm (pip package ftllm) with its experts on disk and a RAM cache of --fastllm-cache."""

    key = "fastllm"
    label = "fastllm (disk)"
    module = "ftllm"
    worker_script = Path(__file__).resolve()

    def __init__(self, *a, cache: str = "2g", **kw):
        super().__init__(*a, **kw)
        self.cache = cache

    def options(self) -> dict:
        return {"moe_device": "disk", "moe_cpu_cache": self.cache}

    @classmethod
    def worker_main(cls, spec: dict) -> dict:
        import ftllm
        from ftllm.benchmark import add_benchmark_args, fastllm_benchmark
        from ftllm.util import make_normal_parser

        o = spec["options"]
        parser = make_normal_parser("fastllm_benchmark")
        add_benchmark_args(parser)
        n_prompt = len(spec["prompt_ids"])
        argv = ["-p", spec["file"], "-t", str(spec["threads"]), "--moe_device", o["moe_device"],
                "--moe_cpu_cache", o["moe_cpu_cache"], "--input_tokens", str(n_prompt),
                "--output_tokens", str(spec["n_decode"] + 1), "--warmup", "1", "--temperature", "0"]
        args = parser.parse_args(argv)
        t0 = time.perf_counter()
        res = fastllm_benchmark(args)
        wall = time.perf_counter() - t0
        if not res.get("tpop_avg") or res["total_output_tokens"] < 2:
            codes = [q["finish_code"] for q in res.get("requests", [])]
            raise RuntimeError(f"fastllm produced {res.get('total_output_tokens')} tokens (finish codes {codes})")
        n_decode = res["total_output_tokens"] - 1
        return {"n_prompt": res["input_tokens"], "n_decode": n_decode, "prefill_s": res["ttft_avg"],
                "prefill_tok_s": res["prefill_tokens_per_second"], "decode_s": res["tpop_avg"] * n_decode,
                "decode_tok_s": 1.0 / res["tpop_avg"], "tokens": [], "top5": [], "load_s": None,
                "wall_in_worker_s": wall, "version": getattr(ftllm, "__version__", None),
                "settings": {"threads": spec["threads"], "argv": argv}, "_first_logits": np.zeros(0, np.float32)}


compare.WORKERS.update({CappedSharpiRunner.key: CappedSharpiRunner, FastllmRunner.key: FastllmRunner})


def parse_bytes(text: str) -> int:
    from sharpi import _core

    return int(_core.parse_byte_size(text))


def drop_all_caches(path) -> str:
    """`sync; echo 3 > /proc/sys/vm/drop_caches` (root), else POSIX_FADV_DONTNEED on the file."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches=3"
    except OSError:
        from sharpi.bench.isolation import drop_page_cache

        return drop_page_cache([os.fspath(path)], "file")


def sharpi_plan(path: Path, n_ctx: int) -> dict:
    """fixed bytes (dense + KV + buffers), slot bytes and expert count of a streamed session."""
    code = ("import json, sys, sharpi\n"
            "s = sharpi.Session(sys.argv[1], threads=1, n_ctx=int(sys.argv[2]), ram_budget='1TiB', reader='pread')\n"
            "st = s.expert_stats(); i = s.info\n"
            "print(json.dumps({'fixed': st['fixed_bytes'], 'slot': st['slot_bytes'], 'dense': i['bytes_dense'],"
            " 'total': i['n_layer'] * i['n_expert']}))\n")
    env = CappedSharpiRunner(1, n_ctx, Path(".")).child_env()
    out = subprocess.run([sys.executable, "-c", code, os.fspath(path), str(n_ctx)], check=True, capture_output=True,
                         text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(args) -> dict:
    from sharpi.bench.isolation import MemoryCap

    path = Path(args.file).expanduser()
    n_ctx = args.prompt + args.decode + 48
    plan = sharpi_plan(path, n_ctx)
    want = plan["fixed"] + int(args.experts_share * plan["total"]) * plan["slot"]
    # "auto": the cap is what sharpi needs for --experts-share plus its headroom, so every engine
    # gets exactly the memory of a 25% (say) expert budget.
    cap = want + parse_bytes(args.sharpi_headroom) if args.cap == "auto" else parse_bytes(args.cap)
    budget_cap = cap - parse_bytes(args.sharpi_headroom)
    budget = min(want, budget_cap)
    share = max(0, (budget - plan["fixed"]) // plan["slot"]) / plan["total"]
    fast_cache = args.fastllm_cache
    if fast_cache == "auto":
        fast_cache = f"{max(256 * MiB, cap - plan['dense'] - 3 * GiB // 2) // MiB}m"
    prompts, source = compare.prompt_ids_for(path, [args.prompt])
    log_dir = Path(args.out) / "logs"
    runners = []
    for name in args.engines.split(","):
        name = name.strip()
        if name == "sharpi":
            runners.append(CappedSharpiRunner(args.threads, n_ctx, log_dir, timeout_s=args.timeout,
                                              ram_budget=budget, reader=args.reader,
                                              predictor=args.sharpi_predictor))
        elif name == "llama.cpp":
            runners.append(CappedLlamaRunner(args.threads, n_ctx, log_dir, timeout_s=args.timeout, no_repack=True))
        elif name == "fastllm":
            runners.append(FastllmRunner(args.threads, n_ctx, log_dir, timeout_s=args.timeout, cache=fast_cache))
        elif name:
            raise SystemExit(f"compare_capped: unknown engine {name!r} (known: sharpi, llama.cpp, fastllm)")
    report = {"file": os.fspath(path), "cap_bytes": cap, "cap": args.cap, "prompt": args.prompt,
              "n_decode": args.decode, "threads": args.threads, "prompt_source": source,
              "sharpi_plan": plan, "sharpi_budget": budget, "sharpi_experts_share": share,
              "sharpi_budget_cut_to_cap": want > budget_cap, "fastllm_cache": fast_cache,
              "read_bw": args.read_bw,
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": []}
    for rep in range(args.repeats):
        for r in runners:  # A B C A B C ...
            how = drop_all_caches(path)
            load = os.getloadavg()[0]
            with MemoryCap(cap) as mc:
                r.wrap = mc.command([])
                res = r.measure(path, prompts[args.prompt], args.decode, tag=f"capped-r{rep}")
                mc.read_counters()
            res = {k: v for k, v in res.items() if not k.startswith("_")}
            res.update(engine=r.key, label=r.label, round=rep, cache_drop=how, loadavg_before=load,
                       cap=mc.report(), options=r.options())
            report["runs"].append(res)
            msg = (f"decode {res['decode_tok_s']:.3f} tok/s, prefill {res['prefill_s']:.1f} s"
                   if res["status"] == compare.STATUS_OK else f"{res['status']}: {res.get('reason', '')}")
            print(f"compare_capped: round {rep + 1}/{args.repeats} {r.label}: {msg}", file=sys.stderr)
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return report


def render(report: dict) -> str:
    gib = report["cap_bytes"] / GiB
    lines = [(f"# Memory-capped comparison: {Path(report['file']).name}, cap {gib:.2f} GiB "
             f"(cgroup v1), page cache dropped before each run"),
             "",
             (f"prompt {report['prompt']} tokens, {report['n_decode']} greedy decode steps, {report['threads']} threads; "
             f"sharpi budget {report['sharpi_budget'] / GiB:.2f} GiB = {report['sharpi_experts_share']:.1%} of the "
             f"expert slots{' (cut to fit the cap)' if report['sharpi_budget_cut_to_cap'] else ''}; "
             f"fastllm --moe_cpu_cache {report['fastllm_cache']}. Shared 2-core machine: noisy."),
             "",
             "| engine | round | status | decode tok/s | TPOT ms | prefill s | peak MiB | failcnt | OOM kills | load |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for x in report["runs"]:
        c = x.get("cap", {})
        peak = c.get("peak_bytes")
        ok = x["status"] == compare.STATUS_OK
        status = "ok" if ok else f"{x['status']}: {x.get('reason', '')[:120]}"
        lines.append(
            f"| {x['label']} | {x['round']} | {status} | {compare._fmt(x.get('decode_tok_s') if ok else None, '.3f')} "
            f"| {compare._fmt(1e3 / x['decode_tok_s'] if ok else None, '.0f')} "
            f"| {compare._fmt(x.get('prefill_s') if ok else None, '.1f')} "
            f"| {compare._fmt(peak / MiB if peak else None, '.0f')} | {c.get('failcnt', '–')} "
            f"| {c.get('oom_kills', '–')} | {x['loadavg_before']:.1f} |")
    streamed = [x for x in report["runs"] if x["status"] == compare.STATUS_OK and "decode_bytes_read" in x]
    if streamed:
        bw = report["read_bw"]
        lines += ["", (f"sharpi's decode against its IO lower bound: expert bytes read per decoded token ÷ "
                       f"{bw / 1e9:.2f} GB/s (--read-bw, the reader's rate on this disk) is the least TPOT "
                       f"the reads allow; TPOT ÷ that bound is 1.0 when decode is all IO."), "",
                  "| round | MB read / token | IO bound ms | TPOT ms | TPOT ÷ IO bound |", "|---|---|---|---|---|"]
        for x in streamed:
            per_token = x["decode_bytes_read"] / x["n_decode"]
            bound_ms = 1e3 * per_token / bw
            tpot_ms = 1e3 / x["decode_tok_s"]
            lines.append(f"| {x['round']} | {per_token / 1e6:.1f} | {bound_ms:.1f} | {tpot_ms:.1f} "
                         f"| {compare._fmt(tpot_ms / bound_ms if bound_ms else None, '.2f')} |")
    lines += ["", "| engine | runs ok | median decode tok/s | sharpi ÷ engine |", "|---|---|---|---|"]
    med = {}
    for key in dict.fromkeys(x["engine"] for x in report["runs"]):
        runs = [x for x in report["runs"] if x["engine"] == key]
        ok = [x["decode_tok_s"] for x in runs if x["status"] == compare.STATUS_OK]
        med[key] = (runs[0]["label"], len(ok), len(runs), statistics.median(ok) if ok else None)
    ref = med.get(CappedSharpiRunner.key, (None, 0, 0, None))[3]
    for key, (label, n_ok, n, m) in med.items():
        ratio = ref / m if ref and m else None
        lines.append(f"| {label} | {n_ok}/{n} | {compare._fmt(m, '.3f')} | {compare._fmt(ratio, '.2f')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("file", nargs="?", help="GGUF file every engine runs")
    ap.add_argument("--cap", default="5.9GiB",
                    help="cgroup memory cap for every run (default: 5.9GiB); auto: sharpi's budget for "
                    "--experts-share plus --sharpi-headroom")
    ap.add_argument("--experts-share", type=float, default=0.25, help="sharpi: share of expert slots (default 0.25)")
    ap.add_argument("--sharpi-headroom", default="400MiB",
                    help="sharpi's budget is at most the cap less this (interpreter, libraries)")
    ap.add_argument("--fastllm-cache", default="auto", help="fastllm --moe_cpu_cache (default: auto, see above)")
    ap.add_argument("--engines", default="sharpi,llama.cpp,fastllm")
    ap.add_argument("--reader", default="auto", choices=["auto", "uring", "pread"])
    ap.add_argument("--sharpi-predictor", default="none",
                    help="sharpi's predictor (e.g. next_gate; its staging slots come out of the same budget)")
    ap.add_argument("--prompt", type=compare.int_at_least(1), default=32)
    ap.add_argument("--decode", type=compare.int_at_least(1), default=4)
    ap.add_argument("--repeats", type=compare.int_at_least(1), default=2)
    ap.add_argument("--threads", type=compare.int_at_least(1), default=2)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    ap.add_argument("--read-bw", type=float, default=1.2e9,
                    help="bytes/s the expert reader reaches on this disk, for the IO lower bound "
                         "(benchmarks/bench_readers.py measures it; default 1.2e9)")
    ap.add_argument("--out", default="bench-out/capped")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return compare.worker(args.worker)
    if not args.file:
        ap.error("give the GGUF file")
    if compare.developer_build():
        sys.path.insert(0, os.fspath(compare.REPO / "python"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = run(args)
    text = render(report)
    (out / "capped.md").write_text(text)
    (out / "capped.json").write_text(json.dumps(report, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
