"""The command line of `sharpi bench`: its options, their parsers, and the options a run resolves to.

What it owns: add_arguments (also used by `sharpi bench` in sharpi.cli), the argparse types of the
bench's own values (budget shares, predictor lists, lookahead, predictor files) and resolve_options,
which fills the defaults --quick changes and finds the recorded trace. Nothing runs here.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..cli_args import positive_int
from .predictors import PREDICTORS, SIDECAR_PREDICTORS
from .workloads import TRACE_FILE, TRAIN_SPLIT, default_trace_path

DESCRIPTION = "`sharpi bench`: decode speed of expert streaming under RAM budgets, against the IO lower bound."


def _shares(text: str) -> list:
    try:
        shares = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--budgets expects comma-separated shares like 0.25,0.5,1.0, got {text!r}"
        ) from None
    if not shares or any(not 0 < s <= 1 for s in shares):
        raise argparse.ArgumentTypeError(f"--budgets: every share must be in (0, 1], got {text!r}")
    return sorted(set(shares))


def _predictor_list(text: str) -> list:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in PREDICTORS]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"--predictors: unknown predictor {bad[0] if bad else text!r}; choose from {', '.join(PREDICTORS)}"
        )
    # none first (the baseline every other one is compared with), then in the order given.
    return ["none"] + [n for n in dict.fromkeys(names) if n != "none"]


def _lookahead(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lookahead must be an integer, got {text!r}") from None
    if not 1 <= value <= 3:
        raise argparse.ArgumentTypeError(f"--lookahead must be 1, 2 or 3, got {value}")
    return value


def parse_predictor_file(text: str) -> tuple:
    """ "[WORKLOAD:]NAME=PATH" -> (workload or None, name, path). WORKLOAD is "random" or "trace";
    without it the file is offered to every workload (a shape mismatch is the engine's error)."""
    key, sep, path = text.partition("=")
    workload, _, name = key.rpartition(":")
    if not sep or not path or name not in SIDECAR_PREDICTORS or workload not in ("", "random", "trace"):
        raise argparse.ArgumentTypeError(
            f"--predictor-file expects [random:|trace:]NAME=PATH with NAME one of {', '.join(SIDECAR_PREDICTORS)}, "
            f"got {text!r}"
        )
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"--predictor-file {text!r}: {path} is not a file")
    return (workload or None, name, path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `sharpi bench` (defaults None where --quick picks its own)."""
    p.add_argument(
        "--out", default="bench-out/streaming", help="folder for bench.json, bench.txt, timeline.json"
    )
    p.add_argument(
        "--model-dir",
        default=None,
        help="where synthetic models are written and reused (default: <out>/../models)",
    )
    p.add_argument("--preset", default=None, help="model preset (default: qwen3-30b-a3b; tiny with --quick)")
    p.add_argument("--quant", default="q4_k_m", help="quantization of the synthetic models (default: q4_k_m)")
    p.add_argument(
        "--budgets",
        type=_shares,
        default=None,
        help="RAM budgets as shares of all expert slots (default: 0.25,0.5,1.0; 0.25,0.5 with --predictors)",
    )
    p.add_argument(
        "--predictors",
        type=_predictor_list,
        default=None,
        help=f"predictors to compare at every budget, comma-separated, from {','.join(PREDICTORS)} "
        "(default: none only; none is always run as the baseline)",
    )
    p.add_argument(
        "--lookahead", type=_lookahead, default=1, help="layers ahead the predictors look, 1..3 (default: 1)"
    )
    p.add_argument(
        "--prefetch-sizing",
        choices=["topk", "bytes"],
        default="topk",
        help="prediction set size of the predictor runs: the best top_k (topk, default) or sized by "
        "expected bytes saved (bytes; docs/predictors.md)",
    )
    p.add_argument(
        "--predictor-file",
        type=parse_predictor_file,
        action="append",
        default=[],
        metavar="[WORKLOAD:]NAME=PATH",
        help="use this sidecar for a cooc/learned/trajectory predictor instead of training one "
        "(WORKLOAD: random or trace; repeatable)",
    )
    p.add_argument(
        "--harvest-tokens",
        type=positive_int("--harvest-tokens"),
        default=None,
        help="tokens harvested from the random-weight model to train its sidecar predictors (default: 512)",
    )
    p.add_argument(
        "--train-tokens",
        type=positive_int("--train-tokens"),
        default=None,
        help="cap on the trace tokens (whole sequences from the train split) predictors are trained on "
        "(default: all of the train split)",
    )
    p.add_argument(
        "--retrain", action="store_true", help="train sidecar predictors even when a trained file exists"
    )
    p.add_argument(
        "--tokens", type=positive_int("--tokens"), default=None, help="measured decode tokens (default: 32)"
    )
    p.add_argument("--warmup", type=positive_int("--warmup"), default=None, help="warm-up tokens (default: 8)")
    p.add_argument(
        "--rounds",
        type=positive_int("--rounds"),
        default=1,
        help="run every streamed configuration this many times, the order of a budget's runs rotated "
        "each round so that none and every predictor run in every position; the report gives medians "
        "over rounds and each predictor's stall cut against the same round's none (default: 1)",
    )
    p.add_argument("--threads", type=positive_int("--threads"), default=2, help="compute threads (default: 2)")
    p.add_argument(
        "--reader", choices=["auto", "uring", "pread"], default="auto", help="expert reader (default: auto)"
    )
    p.add_argument(
        "--cache-policy",
        default=None,
        metavar="NAME[:FILE]",
        help="expert-cache replacement policy of the streamed runs (default: the engine's default)",
    )
    p.add_argument(
        "--trace", default=None, help=f"routing trace to replay (default: ../shared/traces/{TRACE_FILE})"
    )
    p.add_argument(
        "--trace-start",
        type=int,
        default=None,
        help=f"first trace row replayed (default: the first token of the evaluation split, the last "
        f"{1 - TRAIN_SPLIT:.0%}% of the trace's sequences)",  # %% : argparse %-formats help
    )
    p.add_argument("--no-trace", action="store_true", help="skip the trace-replay workload")
    p.add_argument("--no-random", action="store_true", help="skip the random-token workload on --preset")
    p.add_argument(
        "--cap-overhead",
        default="512MiB",
        help="memory cap = budget + this, for the interpreter and libraries (default: 512MiB)",
    )
    p.add_argument("--no-cap", action="store_true", help="run without the cgroup memory cap")
    p.add_argument(
        "--timeline-tokens",
        type=positive_int("--timeline-tokens"),
        default=None,
        help="decoded tokens shown in timeline.json (default: 3)",
    )
    p.add_argument(
        "--bw-bytes", default="1GiB", help="bytes read to measure sequential bandwidth (default: 1GiB)"
    )
    p.add_argument(
        "--drop-cache",
        choices=["all", "file"],
        default=None,
        help="before each run drop the whole page cache (all, as root) or the model file's (file) "
        "(default: all; file with --quick)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the model weights and the decoded tokens")
    p.add_argument("--quick", action="store_true", help="tiny models and few tokens (smoke test, seconds)")


def resolve_options(args: argparse.Namespace) -> dict:
    from .. import _core

    quick = bool(args.quick)
    predictors = list(args.predictors or ["none"])
    budgets = args.budgets or ([0.25, 0.5] if len(predictors) > 1 else [0.25, 0.5, 1.0])
    opts = {
        "out": Path(args.out),
        "preset": args.preset or ("tiny" if quick else "qwen3-30b-a3b"),
        "quant": args.quant,
        "budgets": list(budgets),
        "predictors": predictors,
        "lookahead": args.lookahead,
        "prefetch_sizing": args.prefetch_sizing,
        "predictor_files": [list(x) for x in args.predictor_file],
        "harvest_tokens": args.harvest_tokens or (256 if quick else 512),
        "train_tokens": args.train_tokens or (3000 if quick else None),
        "retrain": bool(args.retrain),
        "tokens": args.tokens or (6 if quick else 32),
        "warmup": args.warmup or (3 if quick else 8),
        "rounds": args.rounds,
        "threads": args.threads,
        "reader": args.reader,
        "cache_policy": args.cache_policy,
        "trace_start": args.trace_start,
        "timeline_tokens": args.timeline_tokens or (2 if quick else 3),
        "cap": not args.no_cap,
        "cap_overhead": _core.parse_byte_size(str(args.cap_overhead)),
        "bw_bytes": _core.parse_byte_size(str(args.bw_bytes)),
        "seed": args.seed,
        "drop_cache": args.drop_cache or ("file" if quick else "all"),
        "quick": quick,
    }
    opts["model_dir"] = Path(args.model_dir) if args.model_dir else opts["out"].parent / "models"
    opts["timeline_tokens"] = min(opts["timeline_tokens"], opts["tokens"])
    opts["random"] = not args.no_random
    if args.no_trace:
        opts["trace"], opts["trace_skip"] = None, "--no-trace given"
    else:
        path = Path(args.trace) if args.trace else default_trace_path()
        if path is None or not path.is_file():
            where = args.trace or f"../shared/traces/{TRACE_FILE} next to the repository"
            opts["trace"], opts["trace_skip"] = None, f"no routing trace at {where}"
        else:
            opts["trace"], opts["trace_skip"] = path, None
    return opts
