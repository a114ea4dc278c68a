"""Bounded load test and soak of `sharpi serve` (issues 20 and 39, not in CI): concurrent clients send
requests until enough have completed or the time is up.

Starts `sharpi serve` on 127.0.0.1 with the model and any extra serve flags (e.g. a RAM budget),
then --clients threads each send chat requests of at most --max-tokens generated tokens (greedy,
prompts cycled from a fixed list) with the official `openai` client until --requests have completed
or --minutes have passed. Records each request's latency and the server's VmHWM / VmRSS
(/proc/PID/status) after the run. Checks: no request failed; with --ram-budget, VmHWM <= budget +
--slack-mib (the interpreter, uvicorn and the client-facing buffers). Prints a table, writes
serve_load.json into --out, exits 1 if a check fails.

The soak of issue 39 (continuous batching): --parallel N serves N requests at once; --mixed makes
prompt lengths vary (the prompt repeated 1..8 times); --disconnect-rate F streams a fraction F of
the requests and closes each of those after its first few chunks, as a client that goes away.
Then, once the clients are done, the server must show no leaked slot: /v1/sharpi/stats reports no
active slot and an empty queue within a few seconds.

    python benchmarks/serve_load.py --model q3.gguf --ram-budget 6GiB --out load-out
    python benchmarks/serve_load.py --requests 40 --out load-out     # the shipped model, a short run
    python benchmarks/serve_load.py --parallel 16 --clients 16 --requests 1000 --minutes 10 \
        --mixed --disconnect-rate 0.1 --out soak-out                   # issue 39's soak
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.request

MIB = 2**20
PROMPTS = [
    "Write a function that reverses a list.",
    "What does a context manager do?",
    "Name three sorting algorithms.",
    "How do I read a file line by line?",
    "Explain list comprehensions briefly.",
]


def proc_status(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    return out


def percentile(values: list, q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else 0.0


@contextlib.contextmanager
def serve(model: str | None, ram_budget: str | None, threads: int, extra: tuple = ()):
    """Runs `sharpi serve` on a free port of 127.0.0.1; yields (port, server Popen) once /health
    answers, stops it afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "sharpi.cli", "serve", "--port", str(port), "-t", str(threads), *extra]
    if model:
        cmd += ["-m", model]
    if ram_budget:
        cmd += ["--ram-budget", ram_budget]
    server = subprocess.Popen(cmd)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("sharpi serve did not come up") from None
                time.sleep(0.5)
        yield port, server
    finally:
        server.terminate()
        server.wait(timeout=60)


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file (default: the shipped model)")
    p.add_argument("--ram-budget", default=None, help="passed to sharpi serve; also the memory check")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--slack-mib", type=int, default=256)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--parallel", type=int, default=1, help="sharpi serve --parallel (slots)")
    p.add_argument("--mixed", action="store_true", help="prompt lengths vary (the prompt 1..8 times)")
    p.add_argument("--disconnect-rate", type=float, default=0.0,
                   help="fraction of requests streamed and abandoned after a few chunks")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import openai

    extra = ("--parallel", str(args.parallel)) if args.parallel != 1 else ()
    with serve(args.model, args.ram_budget, args.threads, extra) as (port, server):
        model_id = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x").models.list().data[0].id

        lock = threading.Lock()
        latencies: list = []
        errors: list = []
        disconnected = [0]
        started = [0]
        t_end = time.monotonic() + args.minutes * 60

        def client_loop(ci: int) -> None:
            c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=600)
            while time.monotonic() < t_end:
                with lock:
                    if started[0] >= args.requests:
                        return
                    i = started[0]
                    started[0] += 1
                rng = random.Random(i)
                prompt = " ".join([PROMPTS[i % len(PROMPTS)]] * (rng.randint(1, 8) if args.mixed else 1))
                messages = [{"role": "user", "content": prompt}]
                t0 = time.perf_counter()
                try:
                    if rng.random() < args.disconnect_rate:
                        stream = c.chat.completions.create(model=model_id, max_tokens=args.max_tokens,
                                                           temperature=0, messages=messages, stream=True)
                        for n, _ in enumerate(stream):
                            if n >= 2:
                                break
                        stream.close()  # the client goes away mid-answer
                        with lock:
                            disconnected[0] += 1
                        continue
                    c.chat.completions.create(model=model_id, max_tokens=args.max_tokens, temperature=0,
                                              messages=messages)
                    with lock:
                        latencies.append(time.perf_counter() - t0)
                except Exception as e:  # noqa: BLE001 - every failure is counted and reported
                    with lock:
                        errors.append(f"request {i}: {type(e).__name__}: {e}")

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        # No leaked slot: once the clients are gone every slot is free and nothing waits (a
        # disconnect is noticed at the next step, so give the worker a moment).
        stats: dict = {}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/sharpi/stats", timeout=10) as r:
                stats = json.load(r)
            if not stats.get("busy") and stats.get("waiting", 0) == 0:
                break
            time.sleep(0.2)
        mem = proc_status(server.pid)

    result = {
        "clients": args.clients, "parallel": args.parallel, "completed": len(latencies),
        "disconnected": disconnected[0], "errors": errors, "wall_s": wall,
        "latency_s": {q: percentile(latencies, v) for q, v in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
        "max_latency_s": max(latencies, default=0.0), "requests_per_s": len(latencies) / wall if wall else 0.0,
        "server_vmhwm": mem.get("VmHWM"), "server_vmrss": mem.get("VmRSS"), "ram_budget": args.ram_budget,
    }
    checks = {"no errors": not errors,
              "no leaked slot": not stats.get("busy") and stats.get("waiting", 0) == 0 and stats.get("active", 0) == 0}
    if args.ram_budget:
        from sharpi._core import parse_byte_size

        budget = parse_byte_size(args.ram_budget)
        checks["VmHWM within budget + slack"] = mem["VmHWM"] <= budget + args.slack_mib * MIB
    result["checks"] = checks
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "serve_load.json"), "w") as f:
        json.dump(result, f, indent=2)

    lat = result["latency_s"]
    print(f"{'clients':>8} {'done':>6} {'errors':>7} {'req/s':>7} {'p50 s':>7} {'p90 s':>7} {'p99 s':>7} "
          f"{'VmHWM MiB':>10}")
    print(f"{args.clients:>8} {len(latencies):>6} {len(errors):>7} {result['requests_per_s']:>7.2f} "
          f"{lat['p50']:>7.3f} {lat['p90']:>7.3f} {lat['p99']:>7.3f} {mem.get('VmHWM', 0) / MIB:>10.1f}")
    for name, ok in checks.items():
        print(f"check {name}: {'ok' if ok else 'FAILED'}")
    for e in errors[:5]:
        print(e, file=sys.stderr)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
