"""`sharpi predictor train|eval`: the command-line front end of the predictor pipeline.

Wiring (python/sharpi/cli.py): `add_predictor_parser(subparsers)` registers the `predictor`
command with its two subcommands; `run_predictor_command(args) -> int` runs the parsed command and
returns the exit status. Errors are sharpi._core exceptions (InvalidArgument, FormatError, ...),
raised for the caller to print; nothing here catches them. `python -m sharpi.predict.cli ...` runs the
same commands standalone (printing errors as "sharpi: error: ...").

    sharpi predictor train --kind cooc|depthtime|learned|trajectory|pregate --trace T.npz --out F
                           [--model M.gguf] [--split 0.7] [--lookahead 3] [--epochs N] [--window W]
                           [--seed S] [--threads N] [--time-budget S]
        cooc / depthtime / learned / trajectory write a sidecar GGUF to F; pregate writes a copy of --model with
        blk.N.ffn_pregate_inp.weight added. depthtime with --model (a trace with hidden states) also
        weighs the gate feature, the model's routers on the hidden states. Training uses the first
        --split of the trace's sequences only.
    sharpi predictor eval --trace T.npz --predictor NAME[:FILE] [--model M.gguf] [--split 0.7]
                          [--heldout H.npz] [--no-baselines]
                          [--cache-experts N] [--expert-bytes B] [--json OUT] [--per-layer]
        NAME: prev_token, cooc, depthtime, learned, trajectory (FILE = sidecar), next_gate (needs
        --model, as does a depthtime sidecar trained with --model), pregate (--model with pre-gate tensors, or pregate:FILE). Scores the last 1 - split
        of the sequences, or with --heldout every sequence of H (T is then all training data); prints
        the split line and a table (rows d = 1..3), then recall@k of every baseline (regression.
        BASELINES, trained on the same training side) beside the predictor's.

What it owns: argument parsing and printing; the work is in traces / train / reference / evaluate.
It writes only the files named by --out and --json.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TextIO

import numpy as np

from ..cli_args import int_at_least
from .reference import PREDICTOR_NAMES
from .regression import DEPTHTIME_NEIGHBOURS, DEPTHTIME_POOL_TOKENS

TRAIN_KINDS = ("cooc", "depthtime", "learned", "trajectory", "pregate")


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}") from None
    if not 0.0 < v < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {v}")
    return v




def add_predictor_parser(subparsers) -> argparse.ArgumentParser:
    """Registers `predictor` (with `train` and `eval`) on an argparse subparsers object."""
    p = subparsers.add_parser(
        "predictor",
        help="train and evaluate expert predictors on routing traces",
        description="Train expert predictors on a routing trace and evaluate them on held-out sequences.",
    )
    sub = p.add_subparsers(dest="predictor_command", metavar="SUBCOMMAND")
    sub.required = True

    tr = sub.add_parser(
        "train", help="train a predictor (writes a sidecar GGUF, or a model copy for pregate)"
    )
    tr.add_argument("--kind", required=True, choices=TRAIN_KINDS)
    tr.add_argument("--trace", required=True, help="routing trace .npz")
    tr.add_argument("--out", required=True, help="output file (sidecar .gguf; model copy for pregate)")
    tr.add_argument("--model", help="model GGUF (pregate; depthtime: add the gate feature)")
    tr.add_argument("--split", type=_fraction, default=0.7, help="fraction of sequences used to train (0.7)")
    tr.add_argument("--lookahead", type=int, choices=(1, 2, 3), default=3, help="largest d predicted (3)")
    tr.add_argument(
        "--epochs", type=int_at_least("--epochs", 1), default=None, help="training epochs (depthtime, learned, trajectory)"
    )
    tr.add_argument(
        "--window",
        type=int,
        choices=range(1, 11),
        default=10,
        metavar="W",
        help="trajectory window, 1..10 (10)",
    )
    tr.add_argument(
        "--pool",
        type=int_at_least("--pool", 0),
        default=None,
        metavar="N",
        help="depthtime: keep the routes of up to N training tokens for the pool votes, 0 = none "
        f"(default {DEPTHTIME_POOL_TOKENS})",
    )
    tr.add_argument(
        "--neighbours",
        type=int_at_least("--neighbours", 1),
        default=None,
        metavar="M",
        help=f"depthtime: the pool tokens that vote, those whose routes match best (default {DEPTHTIME_NEIGHBOURS})",
    )
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--threads", type=int_at_least("--threads", 1), default=1, help="torch threads (1)")
    tr.add_argument(
        "--time-budget",
        type=float,
        default=540.0,
        metavar="S",
        help="trajectory: stop training after S seconds, keeping the best epoch so far (540)",
    )

    ev = sub.add_parser("eval", help="evaluate a predictor on the held-out sequences of a trace")
    ev.add_argument("--trace", required=True, help="routing trace .npz")
    ev.add_argument(
        "--predictor",
        required=True,
        metavar="NAME[:FILE]",
        help=f"one of {', '.join(PREDICTOR_NAMES)}; sidecar kinds take :FILE",
    )
    ev.add_argument("--model", help="model GGUF (next_gate, pregate, depthtime trained with --model)")
    ev.add_argument(
        "--heldout", metavar="H.npz", help="score every sequence of this trace; --trace is all training data"
    )
    ev.add_argument(
        "--no-baselines", action="store_true", help="skip training and scoring the baselines (they take minutes)"
    )
    ev.add_argument(
        "--split", type=_fraction, default=0.7, help="fraction of sequences held for training (0.7)"
    )
    ev.add_argument(
        "--cache-experts",
        type=int_at_least("--cache-experts", 1),
        default=None,
        help="LRU cache size in experts per layer (default n_expert/4)",
    )
    ev.add_argument(
        "--expert-bytes", type=float, default=1.0, help="bytes per expert for the byte counts (1)"
    )
    ev.add_argument("--json", metavar="OUT", help="also write the full result (per layer too) as JSON")
    ev.add_argument("--per-layer", action="store_true", help="also print per-target-layer recall@k")
    return p


def _train(args, out: TextIO) -> int:
    from . import train
    from .sidecar import write_sidecar
    from .traces import load_trace, split_by_sequences

    trace = load_trace(args.trace)
    split = split_by_sequences(trace, args.split)
    source = f"{args.trace}: {split.describe()}"
    out.write(f"split: {split.describe()}\n")
    if args.kind == "depthtime":
        from .regression import train_depthtime

        kw = {} if args.epochs is None else {"epochs": args.epochs}
        if args.pool is not None:
            kw["pool_tokens"] = args.pool
        if args.neighbours is not None:
            kw["neighbours"] = args.neighbours
        routers = None
        if args.model:  # the gate feature: the model's routers on the trace's hidden states
            from .reference import ModelRouters

            routers = ModelRouters(args.model, trace.moe_layer_ids)
            routers.check_trace("depthtime", trace)
        sc = train_depthtime(
            trace,
            split.train,
            max_lookahead=args.lookahead,
            seed=args.seed,
            num_threads=args.threads,
            source=source,
            routers=routers,
            **kw,
        )
    elif args.kind == "cooc":
        sc = train.train_cooc(trace, split.train, max_lookahead=args.lookahead, seed=args.seed, source=source)
    elif args.kind == "trajectory":
        kw = {} if args.epochs is None else {"epochs": args.epochs}
        sc = train.train_trajectory(
            trace,
            split.train,
            max_lookahead=args.lookahead,
            window=args.window,
            seed=args.seed,
            source=source,
            num_threads=args.threads,
            time_budget_s=args.time_budget,
            **kw,
        )
    elif args.kind == "learned":
        kw = {} if args.epochs is None else {"epochs": args.epochs}
        sc = train.train_learned(
            trace,
            split.train,
            max_lookahead=args.lookahead,
            seed=args.seed,
            source=source,
            num_threads=args.threads,
            **kw,
        )
    else:
        if not args.model:
            from sharpi._core import InvalidArgument

            raise InvalidArgument("predictor train --kind pregate needs --model M.gguf")
        info = train.train_pregate(trace, split.train, args.model, args.out)
        out.write(f"wrote {args.out}: {info['n_tensors']} pre-gate tensors, fit R^2 {info['r2']:.4f}\n")
        return 0
    write_sidecar(args.out, sc)
    out.write(f"wrote {args.out} ({sc.kind}, max_lookahead {sc.max_lookahead})\n")
    return 0


def _recall_row(result: dict) -> str:
    return " ".join(
        f"{r['recall_at_k']:8.4f}" if r["recall_at_k"] is not None else f"{'-':>8}" for r in result["rows"]
    )


def _eval(args, out: TextIO) -> int:
    from .evaluate import evaluate, format_table
    from .reference import make_predictor
    from .traces import load_trace, split_by_sequences

    name, _, file = args.predictor.partition(":")
    trace = load_trace(args.trace)
    if args.heldout:
        eval_trace = load_trace(args.heldout)
        train_idx = np.arange(trace.n_tokens, dtype=np.int64)
        eval_idx = np.arange(eval_trace.n_tokens, dtype=np.int64)
        split_text = (
            f"train every sequence of {args.trace} ({trace.n_seq} seqs, {trace.n_tokens} tokens) / "
            f"eval every sequence of {args.heldout} ({eval_trace.n_seq} seqs, {eval_trace.n_tokens} tokens)"
        )
    else:
        eval_trace = trace
        split = split_by_sequences(trace, args.split)
        train_idx, eval_idx, split_text = split.train, split.eval, split.describe()
    predictor = make_predictor(name, eval_trace, file or None, args.model)
    kw = {"cache_experts": args.cache_experts, "expert_bytes": args.expert_bytes}
    result = evaluate(predictor, eval_trace, eval_idx, **kw)
    result["split"] = split_text
    result["trace"] = args.trace
    result["heldout"] = args.heldout
    result["predictor_arg"] = args.predictor
    out.write(f"predictor {args.predictor} on {args.heldout or args.trace}\n")
    out.write(f"split: {split_text}\n")
    out.write(format_table(result) + "\n")
    if args.per_layer:
        for d, rows in result["per_layer"].items():
            cells = " ".join(
                f"{r['layer']}:{r['recall_at_k']:.3f}" for r in rows if r["recall_at_k"] is not None
            )
            out.write(f"d={d} recall@k per target layer: {cells}\n")
    if not args.no_baselines:
        from .regression import baseline_predictors

        if trace.n_layer != eval_trace.n_layer or trace.n_expert != eval_trace.n_expert:
            from sharpi._core import InvalidArgument

            raise InvalidArgument(
                f"--heldout {args.heldout}: {eval_trace.n_layer} layers x {eval_trace.n_expert} experts, "
                f"--trace {args.trace} has {trace.n_layer} x {trace.n_expert}"
            )
        result["baselines"] = {}
        out.write(f"recall@k on the same split   {'d=1':>8} {'d=2':>8} {'d=3':>8}\n")
        out.write(f"{args.predictor:<28} {_recall_row(result)}\n")
        best = None
        for b_name, b in baseline_predictors(trace, train_idx):
            r = evaluate(b, eval_trace, eval_idx, **kw)
            result["baselines"][b_name] = r
            out.write(f"{'baseline ' + b_name:<28} {_recall_row(r)}\n")
            rec = [row["recall_at_k"] or 0.0 for row in r["rows"]]
            best = rec if best is None else [max(x, y) for x, y in zip(best, rec)]
        margin = [(row["recall_at_k"] or 0.0) - b for row, b in zip(result["rows"], best)]
        result["margin_over_best_baseline"] = margin
        out.write(f"{'margin over best baseline':<28} " + " ".join(f"{m:+8.4f}" for m in margin) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def run_predictor_command(args, out: TextIO | None = None) -> int:
    """Runs a parsed `predictor` command; returns the exit status (0). Raises sharpi errors."""
    out = out or sys.stdout
    if args.predictor_command == "train":
        return _train(args, out)
    return _eval(args, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sharpi")
    add_predictor_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    from sharpi._core import SharpiError

    try:
        return run_predictor_command(args)
    except (SharpiError, OSError) as e:
        sys.stderr.write(f"sharpi: error: {e}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
