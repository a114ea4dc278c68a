"""Prompt-prefix reuse in `sharpi serve` (issue 20, acceptance 5): time to first token of a request
that shares an N-token prefix with the one before it, against the same request on a cold cache.

Each trial sends an unrelated prompt (the cache then holds nothing of the prefix), then prompt A =
prefix + one ending (cold: the whole prompt is prefilled), then prompt B = prefix + another ending
(warm: only what follows the shared prefix is prefilled). TTFT is the server's own `timings.ttft_ms`
(prefill and the first sample, on the worker's clock). B's greedy answer must equal that of a fresh
in-process Session (a cold cache). Prints a table, writes prefix_reuse.json into --out, and exits 1
when an answer differs or the warm/cold ratio exceeds --max-ratio (0.2, the issue's bound).

    python benchmarks/prefix_reuse.py --out reuse-out                   # the shipped model
    python benchmarks/prefix_reuse.py --model q3.gguf --ram-budget 6GiB --out reuse-out
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_load import serve

FILLER = "def f{i}(x, y):\n    \"\"\"Add {i} to the product.\"\"\"\n    return x * y + {i}\n\n\n"


def shared_prefix(tokenize, n_tokens: int) -> str:
    """Python source of at least n_tokens tokens."""
    text, i = "", 0
    while len(tokenize(text)) < n_tokens:
        text += FILLER.format(i=i)
        i += 1
    return text


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file (default: the shipped model)")
    p.add_argument("--ram-budget", default=None, help="passed to sharpi serve")
    p.add_argument("--prefix-tokens", type=int, default=500)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-ratio", type=float, default=0.2)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import openai
    import sharpi
    from sharpi.models import default_model_path

    path = args.model or default_model_path()
    ref = sharpi.Session(path, threads=args.threads, n_ctx=2048)
    prefix = shared_prefix(ref.tokenize, args.prefix_tokens)
    prompt_a, prompt_b = prefix + "class Vector:", prefix + "def main(argv):"
    ref.reset()
    want_b = "".join(ref.generate(prompt_b, max_tokens=args.max_tokens, temperature=0.0))
    n_prefix = len(ref.tokenize(prefix))

    rows = []
    with serve(args.model, args.ram_budget, args.threads, ("-c", "2048")) as (port, _):
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=600)
        model_id = c.models.list().data[0].id

        def ask(prompt: str):
            return c.completions.create(model=model_id, prompt=prompt, max_tokens=args.max_tokens, temperature=0)

        for _ in range(args.trials):
            ask("import numpy as np\n")
            a, b = ask(prompt_a), ask(prompt_b)
            rows.append({"cold_ttft_ms": a.model_extra["timings"]["ttft_ms"],
                         "warm_ttft_ms": b.model_extra["timings"]["ttft_ms"],
                         "cold_prompt_tokens": a.usage.prompt_tokens, "warm_prompt_tokens": b.usage.prompt_tokens,
                         "warm_cached_tokens": b.usage.prompt_tokens_details.cached_tokens,
                         "warm_answer_equals_cold": b.choices[0].text == want_b})

    cold = statistics.median(r["cold_ttft_ms"] for r in rows)
    warm = statistics.median(r["warm_ttft_ms"] for r in rows)
    result = {"model": path, "ram_budget": args.ram_budget, "prefix_tokens": n_prefix, "trials": rows,
              "cold_ttft_ms_median": cold, "warm_ttft_ms_median": warm, "ratio": warm / cold}
    checks = {"answers equal a cold cache's": all(r["warm_answer_equals_cold"] for r in rows),
              f"warm/cold TTFT <= {args.max_ratio}": result["ratio"] <= args.max_ratio}
    result["checks"] = checks
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "prefix_reuse.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"{'prefix':>7} {'prompt':>7} {'cached':>7} {'cold TTFT ms':>13} {'warm TTFT ms':>13} {'ratio':>6}")
    for r in rows:
        print(f"{n_prefix:>7} {r['warm_prompt_tokens']:>7} {r['warm_cached_tokens']:>7} {r['cold_ttft_ms']:>13.1f} "
              f"{r['warm_ttft_ms']:>13.1f} {r['warm_ttft_ms'] / r['cold_ttft_ms']:>6.3f}")
    print(f"median warm/cold TTFT: {result['ratio']:.3f}")
    for name, ok in checks.items():
        print(f"check {name}: {'ok' if ok else 'FAILED'}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
