#!/usr/bin/env python3
"""Prefill and decode speed of the resident CPU engine, and the fraction of the memory-bandwidth
limit reached in decode.

For each (preset, quant) the script writes a synthetic model once (sharpi make-model; reused from
--model-dir on later runs), prefills a prompt, decodes greedily, and reports:
  prefill tok/s, decode tok/s, TPOT,
  bytes touched per decoded token  = dense weights + k/E of every expert tensor + one embedding row,
  bandwidth limit tok/s            = measured copy bandwidth / bytes per token,
  fraction of limit                = decode tok/s / limit tok/s   (goal >= 0.7).
Copy bandwidth is measured here, in the same run, as numpy copies of a 1 GiB array (bytes read +
bytes written per second). With llama-cpp-python installed, llama.cpp decodes the same file with
the same thread count side by side.

    python benchmarks/bench_decode.py --out bench-out/decode [--presets olmoe-1b-7b] [--quants q4_k_m,q8_0]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import sharpi
from sharpi import _core
from sharpi.make_model import write_model


def copy_bandwidth_gbps(size_bytes: int = 1 << 30, repeats: int = 5) -> float:
    src = np.ones(size_bytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * size_bytes / best / 1e9  # read + write


def bytes_per_token(path: str) -> float:
    f = _core.GgufFile(path)
    md = f.metadata()
    arch = md["general.architecture"]
    n_expert = int(md.get(f"{arch}.expert_count", 0))
    k = int(md.get(f"{arch}.expert_used_count", 0))
    tensors = f.tensors()
    names = {t["name"] for t in tensors}
    total = 0.0
    for t in tensors:
        if "_exps." in t["name"]:
            total += t["nbytes"] * k / n_expert
        elif t["name"] == "token_embd.weight" and "output.weight" in names:
            total += t["nbytes"] / t["shape"][1]  # one row per token
        else:
            total += t["nbytes"]
    return total


def run_sharpi(path: str, threads: int, n_prompt: int, n_decode: int, cache_type: str = "f16") -> dict:
    s = sharpi.Session(path, threads=threads, n_ctx=n_prompt + n_decode + 8, cache_type_k=cache_type,
                       cache_type_v=cache_type)
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, s.info["n_vocab"] - 10, size=n_prompt).tolist()
    t0 = time.perf_counter()
    logits = s.decode(prompt)
    t_prefill = time.perf_counter() - t0
    token = int(np.argmax(logits))
    t1 = time.perf_counter()
    for _ in range(n_decode):
        token = int(np.argmax(s.decode([token])))
    t_decode = time.perf_counter() - t1
    return {"prefill_tok_s": n_prompt / t_prefill, "decode_tok_s": n_decode / t_decode, "tpot_ms": 1e3 * t_decode / n_decode}


def run_llama_cpp(path: str, threads: int, n_prompt: int, n_decode: int):
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    n_ctx = n_prompt + n_decode + 8  # n_batch = n_ctx: llama-cpp-python keeps n_batch rows of scores
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=n_ctx, verbose=False)
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, llm.n_vocab() - 10, size=n_prompt).tolist()
    t0 = time.perf_counter()
    llm.eval(prompt)
    t_prefill = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(n_decode):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        llm.eval([token])
    t_decode = time.perf_counter() - t1
    return {"prefill_tok_s": n_prompt / t_prefill, "decode_tok_s": n_decode / t_decode, "tpot_ms": 1e3 * t_decode / n_decode}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-out/decode", help="folder for the table and the JSON")
    ap.add_argument("--model-dir", default="bench-out/models", help="where synthetic models are written/reused")
    ap.add_argument("--presets", default="olmoe-1b-7b")
    ap.add_argument("--quants", default="q4_k_m,q8_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--cache-types", default="f16", help="KV cache types to compare, e.g. f32,f16,q8_0 (sharpi only)")
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp even when installed")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.model_dir, exist_ok=True)

    bw = copy_bandwidth_gbps()
    rows = []
    for preset in args.presets.split(","):
        for quant in args.quants.split(","):
            path = os.path.join(args.model_dir, f"{preset}-{quant}.gguf")
            if not os.path.exists(path):
                t0 = time.perf_counter()
                write_model(path, preset=preset, quant=quant, seed=0)
                print(f"wrote {path} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            bpt = bytes_per_token(path)
            limit = bw * 1e9 / bpt
            r = {"preset": preset, "quant": quant, "threads": args.threads, "copy_gbps": bw,
                 "bytes_per_token": bpt, "limit_tok_s": limit}
            r["llama_cpp"] = None if args.no_llama_cpp else run_llama_cpp(path, args.threads, args.prompt, args.decode)
            for cache_type in args.cache_types.split(","):
                r = dict(r, kv=cache_type)
                r["sharpi"] = run_sharpi(path, args.threads, args.prompt, args.decode, cache_type)
                r["sharpi"]["fraction_of_limit"] = r["sharpi"]["decode_tok_s"] / limit
                rows.append(r)
                r = dict(r, llama_cpp=None)  # llama.cpp once per file, with its default f16 KV

    lines = [f"copy bandwidth {bw:.1f} GB/s, {args.threads} threads, prompt {args.prompt}, decode {args.decode}", "",
             "| model | quant | MB/token | limit tok/s | engine | KV | prefill tok/s | decode tok/s | TPOT ms | of limit |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for engine in ("sharpi", "llama_cpp"):
            m = r[engine]
            if m is None:
                continue
            frac = m["decode_tok_s"] / r["limit_tok_s"]
            lines.append(f"| {r['preset']} | {r['quant']} | {r['bytes_per_token'] / 1e6:.0f} | {r['limit_tok_s']:.1f} | "
                         f"{engine} | {r['kv'] if engine == 'sharpi' else 'f16'} | {m['prefill_tok_s']:.1f} | {m['decode_tok_s']:.2f} | {m['tpot_ms']:.1f} | {frac:.2f} |")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(args.out, "decode.md"), "w") as fh:
        fh.write(table + "\n")
    with open(os.path.join(args.out, "decode.json"), "w") as fh:
        json.dump(rows, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
