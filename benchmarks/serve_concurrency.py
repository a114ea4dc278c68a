"""Concurrent clients against `sharpi serve --parallel N` and `llama-server -np N` (issue 39, not in
CI): aggregate output tokens/s and time to first token at several concurrencies.

For each concurrency c (default 1 2 4 8 16) both servers are started with c slots on the same GGUF
file and the same thread count, and c clients each send --requests-per-client streaming chat
requests one after the other (greedy, --max-tokens, prompts cycled from a fixed list so clients
differ). The load generator is this file's bounded asyncio client (httpx, already a dependency of
the `openai` client): every request is a streaming /v1/chat/completions with
stream_options.include_usage, TTFT is the time to the first content or reasoning delta, and the
tokens are the usage's completion_tokens. Aggregate = all completion tokens / wall time from the
first request to the last answer. Engines alternate per repetition and the table gives the median
of --repeats (default 3). Writes serve_concurrency.json into --out.

    python benchmarks/serve_concurrency.py --model /tmp/bench/olmoe-q4km.gguf --threads 2 --out conc
    python benchmarks/serve_concurrency.py --model M --llama-server PATH --concurrency 1 8 --repeats 1

Under a memory cap (issue 39's streamed case): --cgroup DIR runs each server inside that cgroup v1
memory cgroup (made and sized beforehand, e.g. memory.limit_in_bytes), --drop-caches empties the
page cache before each server starts (root), and --sharpi-args passes e.g. --ram-budget to sharpi.
sharpi's expert bytes read per generated token (/metrics) are recorded for each run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The benchmarks' shared prompts and server start-up.
from serve_load import PROMPTS
from server_parity import free_port, started


async def one_request(client: httpx.AsyncClient, port: int, model: str, prompt: str, max_tokens: int) -> tuple:
    """(ttft seconds, completion tokens) of one streaming chat request."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                if ttft is None and (delta.get("content") or delta.get("reasoning_content")):
                    ttft = time.perf_counter() - t0
            if event.get("usage"):
                tokens = event["usage"].get("completion_tokens", 0)
    return (ttft if ttft is not None else time.perf_counter() - t0), tokens


async def load(port: int, model: str, clients: int, per_client: int, max_tokens: int) -> dict:
    ttfts, tokens = [], 0

    async def client_loop(k: int):
        nonlocal tokens
        async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0)) as client:
            for i in range(per_client):
                ttft, n = await one_request(client, port, model, PROMPTS[(k + i) % len(PROMPTS)], max_tokens)
                ttfts.append(ttft)
                tokens += n

    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop(k) for k in range(clients)))
    wall = time.perf_counter() - t0
    ttfts.sort()
    return {"tok_s": tokens / wall, "ttft_p50_ms": 1e3 * ttfts[len(ttfts) // 2],
            "ttft_p95_ms": 1e3 * ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))],
            "tokens": tokens, "wall_s": wall}


def in_cgroup(cgroup: str | None, cmd: list) -> list:
    """cmd, started inside the cgroup v1 directory `cgroup` (the shell joins it, then execs cmd)."""
    if not cgroup:
        return cmd
    return ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *cmd]


def expert_bytes_per_token(port: int) -> float | None:
    """sharpi's sharpi_expert_read_bytes_per_token gauge (None when absent: llama-server)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("sharpi_expert_read_bytes_per_token "):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


def sharpi_cmd(args, port: int, slots: int) -> list:
    cmd = [sys.executable, "-m", "sharpi.cli", "serve", "-m", args.model, "--host", "127.0.0.1", "--port",
           str(port), "-t", str(args.threads), "-c", str(args.ctx), "--parallel", str(slots)]
    return cmd + list(args.sharpi_args)


def llama_cmd(args, port: int, slots: int) -> list:
    # llama-server's -c is the total context shared by its slots: -c ctx * slots gives each slot ctx.
    return [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port), "-t",
            str(args.threads), "-tb", str(args.threads), "-c", str(args.ctx * slots), "-np", str(slots),
            "--jinja", "--no-webui", *args.llama_args]


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--llama-server", default=str(Path.home() / ".cache/sharpi/converter/llama-tools-0.3.36/bin"
                                                  / "llama-server"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=1024, help="context per slot")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", nargs="+", default=["sharpi", "llama"], choices=["sharpi", "llama"])
    ap.add_argument("--sharpi-args", nargs=argparse.REMAINDER, default=[])
    ap.add_argument("--llama-args", nargs="*", default=[])
    ap.add_argument("--cgroup", default=None, help="a cgroup v1 memory directory to run the servers in")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before each server")
    ap.add_argument("--out", default="serve-concurrency")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    for c in args.concurrency:
        for rep in range(args.repeats):
            order = args.engines if rep % 2 == 0 else list(reversed(args.engines))
            for engine in order:
                port = free_port()
                cmd = in_cgroup(args.cgroup, sharpi_cmd(args, port, c) if engine == "sharpi" else llama_cmd(args, port, c))
                if args.drop_caches:
                    subprocess.run(["sh", "-c", "sync && echo 3 > /proc/sys/vm/drop_caches"], check=True)
                with started(engine, cmd, port, out / f"{engine}-{c}-{rep}.log"):
                    # The model id sharpi serves (the file's name); llama-server takes any.
                    model = Path(args.model).name
                    asyncio.run(load(port, model, 1, 1, 8))  # warm-up: page in the weights
                    r = asyncio.run(load(port, model, c, args.requests_per_client, args.max_tokens))
                    r["expert_bytes_per_token"] = expert_bytes_per_token(port)
                results.setdefault(f"{engine}/{c}", []).append(r)
                per_token = r["expert_bytes_per_token"]
                read = f", {per_token / 2**20:.1f} MiB of experts read per token" if per_token else ""
                print(f"c={c} rep={rep} {engine}: {r['tok_s']:.1f} tok/s, TTFT p50 {r['ttft_p50_ms']:.0f} ms "
                      f"p95 {r['ttft_p95_ms']:.0f} ms ({r['tokens']} tokens{read})", flush=True)
    (out / "serve_concurrency.json").write_text(json.dumps(results, indent=1))
    print("\n| clients | " + " | ".join(f"{e} tok/s | {e} TTFT p50/p95 ms" for e in args.engines) + " | ratio |")
    print("|---" * (2 * len(args.engines) + 2) + "|")
    for c in args.concurrency:
        cells, rates = [], {}
        for e in args.engines:
            runs = results[f"{e}/{c}"]
            rates[e] = statistics.median(r["tok_s"] for r in runs)
            p50 = statistics.median(r["ttft_p50_ms"] for r in runs)
            p95 = statistics.median(r["ttft_p95_ms"] for r in runs)
            cells += [f"{rates[e]:.1f}", f"{p50:.0f} / {p95:.0f}"]
        ratio = rates["sharpi"] / rates["llama"] if len(rates) == 2 and rates["llama"] else float("nan")
        print(f"| {c} | " + " | ".join(cells) + f" | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
