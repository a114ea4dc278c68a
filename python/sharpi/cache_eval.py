"""`sharpi cache-eval` and `sharpi cache-prior`: the expert cache's replacement policies replayed on
real routing against Belady's optimum, and the frequency prior the "prior" policy reads.

What it owns: turning a routing trace (shared/traces format, sharpi.predict.traces) into the step
sequence the decode thread would acquire — token by token, layer by layer, each step the layer's
distinct experts in increasing id order — on the trace's held-out sequences (the repo's split:
the first 70% of sequences train, the rest are scored; sharpi.predict.traces.split_by_sequences,
as `sharpi bench` and `sharpi predictor` use it), and replaying it through every policy with the
engine's own code (sharpi._internal.replay_policy: the calls ExpertCache::acquire makes on a demand
cache, moe/policy_replay.h). Belady's misses (sharpi.belady.belady) on the same steps and capacity
are the bound; each policy's misses are reported as a multiple of them. Every run starts cold.

What is learned, and from what: the "prior" policy's table (expected uses per token of every
(layer, expert)) and the "predictive" policy's hints (a cross-layer co-occurrence
table predicting layer L+1 from layer L) are fitted on the train sequences only, so no
policy sees the sequences it is scored on. Budgets are shares of every expert of the model
(n_slots = round(share x n_layer x n_expert), at least top_k), as `sharpi bench` counts them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TextIO

import numpy as np

TRAIN_FRACTION = 0.7
PRIOR_ARCH = "sharpi.cache_prior"


# -- the prior ---------------------------------------------------------------------------------


def fit_prior(trace, train_idx: np.ndarray) -> np.ndarray:
    """float32 [n_layer, n_expert]: how often each expert was selected per token of train_idx."""
    counts = np.zeros((trace.n_layer, trace.n_expert), dtype=np.float64)
    rows = trace.experts[train_idx]  # [tokens, n_layer, k]
    for il in range(trace.n_layer):
        ids = rows[:, il, :].ravel()
        counts[il] = np.bincount(ids[ids >= 0], minlength=trace.n_expert)
    return (counts / max(len(train_idx), 1)).astype(np.float32)


def write_prior(path: str, prior: np.ndarray, source: str = "") -> None:
    """Writes a cache prior GGUF (cpp/src/gguf/cache_prior_file.h); `<path>.tmp` renamed when done."""
    import gguf

    tmp = str(path) + ".tmp"
    w = gguf.GGUFWriter(tmp, PRIOR_ARCH)
    w.add_uint32(PRIOR_ARCH + ".n_layer", int(prior.shape[0]))
    w.add_uint32(PRIOR_ARCH + ".n_expert", int(prior.shape[1]))
    w.add_string(PRIOR_ARCH + ".source", source)
    w.add_tensor("cache_prior.freq", np.ascontiguousarray(prior, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, str(path))


# -- steps and replay --------------------------------------------------------------------------


class Steps:
    """The acquisition sequence of some tokens: step j = token j // n_layer, layer j % n_layer."""

    def __init__(self, experts: np.ndarray):
        n_tok, n_layer, _ = experts.shape
        rows = np.sort(experts.reshape(n_tok * n_layer, -1).astype(np.int32), axis=1)
        valid = rows >= 0
        self.n_layer = n_layer
        self.layer = np.tile(np.arange(n_layer, dtype=np.int32), n_tok)
        self.offsets = np.concatenate([[0], np.cumsum(valid.sum(axis=1))]).astype(np.int64)
        self.experts = rows[valid].astype(np.int32)  # row-major: each step's ids in increasing order

    def __len__(self) -> int:
        return len(self.layer)

    def key_sets(self, n_expert: int) -> list:
        """Step sets of keys il * n_expert + e, for sharpi.belady."""
        keys = self.layer.repeat(np.diff(self.offsets)).astype(np.int64) * n_expert + self.experts
        bounds = self.offsets.tolist()
        flat = keys.tolist()
        return [frozenset(flat[bounds[i] : bounds[i + 1]]) for i in range(len(self))]


def cooc_hints(trace, train_idx: np.ndarray, eval_idx: np.ndarray, lookahead: int = 2) -> tuple:
    """(offsets, layer, expert): after step (token, L), for d = 1..lookahead, the top_k experts of
    layer L+d that co-occur most, on the train sequences, with the token's choices at layer L (a
    cross-layer co-occurrence table, the cooc predictor's leading term, counted in seconds; recall@k
    ~0.48 at L+1 on DeepSeek per shared/traces/README.md). As in the engine, a protection lasts until
    its layer's gate, so only hints for L+2 and beyond outlive an eviction. Offsets index the hints."""
    n_tok, n_layer, k = len(eval_idx), trace.n_layer, trace.top_k
    per_step: list = [[] for _ in range(n_layer)]  # per source layer: [(target, ids [n_tok, k])]
    for il in range(n_layer):
        for t in range(il + 1, min(il + lookahead, n_layer - 1) + 1):
            table = trace.multi_hot(train_idx, il).T @ trace.multi_hot(train_idx, t)  # [E, E]
            table += trace.multi_hot(train_idx, t).mean(axis=0) * 1e-3  # ties: the more popular
            scores = trace.multi_hot(eval_idx, il) @ table
            per_step[il].append((t, np.argsort(-scores, axis=1, kind="stable")[:, :k].astype(np.int32)))
    counts = np.array([k * len(p) for p in per_step], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(np.tile(counts, n_tok))]).astype(np.int64)
    hint_layer = np.empty(int(offsets[-1]), dtype=np.int32)
    hint_expert = np.empty(int(offsets[-1]), dtype=np.int32)
    for il in range(n_layer):
        col = 0
        for t, ids in per_step[il]:
            for tok in range(n_tok):
                at = int(offsets[tok * n_layer + il]) + col
                hint_layer[at : at + k] = t
                hint_expert[at : at + k] = ids[tok]
            col += k
    return offsets, hint_layer, hint_expert


def replay(name: str, steps: Steps, capacity: int, prior=None, hints=None, **knobs) -> np.ndarray:
    """Misses per step of policy `name` (the engine's code) on `steps` with `capacity` slots."""
    from . import _internal

    policy = _internal.ReplacementPolicy(name, capacity, prior=prior, **knobs)
    h = hints if hints is not None else (None, None, None)
    return _internal.replay_policy(policy, capacity, steps.layer, steps.offsets, steps.experts, *h)


def capacity_for(share: float, n_layer: int, n_expert: int, top_k: int) -> int:
    total = n_layer * n_expert
    return min(total, max(top_k, round(share * total)))


def evaluate(
    trace_path: str,
    budgets: list,
    policies: list | None = None,
    train_fraction: float = TRAIN_FRACTION,
    max_eval_tokens: int | None = None,
    quiet: bool = True,
    horizons: list | None = None,
) -> dict:
    """Every policy's misses and misses / Belady's at each budget, on the held-out sequences.
    horizons: token counts h; for each, Belady's rule knowing only the next h tokens' routing
    (h x n_layer steps; sharpi.belady.belady_horizon) is scored too, as row "belady@h"."""
    from . import _internal
    from .belady import belady, belady_horizon
    from .predict.traces import load_trace, split_by_sequences

    trace = load_trace(trace_path)
    split = split_by_sequences(trace, train_fraction)
    eval_idx = split.eval if max_eval_tokens is None else split.eval[:max_eval_tokens]
    names = list(policies) if policies else list(_internal.replacement_policy_names())
    steps = Steps(trace.experts[eval_idx])
    sets = steps.key_sets(trace.n_expert)
    prior = fit_prior(trace, split.train) if "prior" in names else None
    hints = cooc_hints(trace, split.train, eval_idx) if "predictive" in names else None
    out = {
        "trace": os.path.basename(trace_path),
        "split": split.describe(),
        "eval_tokens": len(eval_idx),
        "n_layer": trace.n_layer,
        "n_expert": trace.n_expert,
        "top_k": trace.top_k,
        "accesses": len(steps.experts),
        "budgets": [],
    }
    for share in budgets:
        cap = capacity_for(share, trace.n_layer, trace.n_expert, trace.top_k)
        t0 = time.perf_counter()
        opt = belady(sets, cap).misses
        row = {"share": share, "capacity": cap, "belady": opt, "policies": {}}
        for name in names:
            misses = int(
                replay(
                    name,
                    steps,
                    cap,
                    prior=prior if name == "prior" else None,
                    hints=hints if name == "predictive" else None,
                ).sum()
            )
            row["policies"][name] = {"misses": misses, "ratio": misses / opt if opt else None}
        for h in horizons or []:
            misses = belady_horizon(sets, cap, h * trace.n_layer).misses
            row["policies"][f"belady@{h:g}"] = {"misses": misses, "ratio": misses / opt if opt else None}
        row["seconds"] = time.perf_counter() - t0
        out["budgets"].append(row)
    return out


def format_table(results: list) -> str:
    """Markdown table: one row per policy, one column per (trace, budget)."""
    cols = [(r["trace"], b) for r in results for b in r["budgets"]]
    names = list(results[0]["budgets"][0]["policies"]) if results and results[0]["budgets"] else []
    head = "| policy | " + " | ".join(f"{t} {b['share']:.0%} ({b['capacity']})" for t, b in cols) + " |"
    sep = "|---|" + "---:|" * len(cols)
    lines = [head, sep]
    for name in names:
        cells = []
        for _, b in cols:
            p = b["policies"].get(name)
            cells.append("-" if p is None or p["ratio"] is None else f"{p['ratio']:.3f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| Belady misses | " + " | ".join(str(b["belady"]) for _, b in cols) + " |")
    return "\n".join(lines)


# -- command line ------------------------------------------------------------------------------


def _shares(text: str) -> list:
    try:
        vals = [float(x) / 100.0 for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"budgets must be percentages like 10,25,50, got {text!r}") from None
    if not vals or any(not 0 < v <= 1 for v in vals):
        raise argparse.ArgumentTypeError(f"budgets must be percentages in (0, 100], got {text!r}")
    return vals


def _horizons(text: str) -> list:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"horizons must be token counts like 0.5,1,10, got {text!r}") from None
    if not vals or any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"horizons must be token counts >= 0, got {text!r}")
    return vals


def add_parsers(sub) -> None:
    ev = sub.add_parser(
        "cache-eval",
        help="replay real routing through every cache policy against Belady",
        description="Misses of each expert-cache replacement policy (the engine's code) / Belady's "
        "misses on the held-out sequences of routing traces, at budgets given as a share of all experts.",
    )
    ev.add_argument(
        "--trace", action="append", required=True, metavar="NPZ", help="routing trace (repeatable)"
    )
    ev.add_argument(
        "--budgets",
        type=_shares,
        default=[0.10, 0.25, 0.50],
        metavar="PCT,...",
        help="cache sizes in percent of all experts (default: 10,25,50)",
    )
    ev.add_argument("--policies", default=None, metavar="NAME,...", help="policies (default: all)")
    ev.add_argument(
        "--train-fraction",
        type=float,
        default=TRAIN_FRACTION,
        help="share of sequences the prior and the predictor learn from (default: 0.7)",
    )
    ev.add_argument(
        "--max-eval-tokens", type=int, default=None, help="score only the first N held-out tokens"
    )
    ev.add_argument(
        "--horizons",
        type=_horizons,
        default=None,
        metavar="TOKENS,...",
        help="also score Belady's rule knowing only the next N tokens' routing (rows belady@N)",
    )
    ev.add_argument("--json", default=None, metavar="FILE", help="write every number as JSON")

    pr = sub.add_parser(
        "cache-prior",
        help="fit the 'prior' cache policy's table from a trace",
        description="Counts how often each (layer, expert) is routed to on a trace's train sequences "
        "and writes the table as a cache prior GGUF for --cache-policy prior:FILE.",
    )
    pr.add_argument("--trace", required=True, metavar="NPZ", help="routing trace (e.g. from `sharpi trace`)")
    pr.add_argument(
        "--train-fraction",
        type=float,
        default=TRAIN_FRACTION,
        help="fit on the first share of sequences (default: 0.7; 1 = all)",
    )
    pr.add_argument("-o", "--out", required=True, metavar="FILE", help="output GGUF")


def cmd_cache_eval(args, out: TextIO) -> int:
    names = [x.strip() for x in args.policies.split(",")] if args.policies else None
    horizons = args.horizons
    results = []
    for path in args.trace:
        res = evaluate(
            path, args.budgets, names, args.train_fraction, args.max_eval_tokens, horizons=horizons
        )
        out.write(f"{res['trace']}: {res['split']}, {res['accesses']} expert accesses\n")
        results.append(res)
    out.write("misses / Belady misses (capacity in slots)\n")
    out.write(format_table(results) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def cmd_cache_prior(args, out: TextIO) -> int:
    from .predict.traces import load_trace, split_by_sequences

    trace = load_trace(args.trace)
    if args.train_fraction >= 1.0:
        train, what = np.arange(trace.n_tokens), f"all {trace.n_seq} sequences"
    else:
        split = split_by_sequences(trace, args.train_fraction)
        train, what = split.train, f"sequences [0, {split.n_train_seq})"
    prior = fit_prior(trace, train)
    write_prior(args.out, prior, source=f"{os.path.basename(args.trace)} {what}")
    out.write(
        f"wrote {args.out}: prior [{trace.n_layer}, {trace.n_expert}] from {what} ({len(train)} tokens)\n"
    )
    return 0


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sharpi")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parsers(sub)
    args = parser.parse_args(argv)
    fn = cmd_cache_eval if args.command == "cache-eval" else cmd_cache_prior
    return fn(args, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
