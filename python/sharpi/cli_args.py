"""Argparse helpers shared by the `sharpi` subcommands: typed integer options and the compute options.

What it owns: argparse `type=` callables whose error messages name the option, and the -t/-c pair
every command that runs a Session takes. It imports nothing from sharpi, so any command module
(sharpi.cli, sharpi.harvest, sharpi.predict.cli, sharpi.bench) can use it without an import loop:
sharpi.cli registers the subcommands, the subcommand modules never import sharpi.cli.
"""

from __future__ import annotations

import argparse


def int_at_least(name: str, minimum: int):
    """An argparse type: an integer >= minimum, with a message naming the option."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be >= {minimum}, got {value}")
        return value

    return parse


def non_negative_int(name: str):
    """An argparse type: an integer >= 0 (0 usually means "the default")."""
    return int_at_least(name, 0)


def positive_int(name: str):
    """An argparse type: an integer > 0 ("{name} must be > 0" when it is not)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be > 0, got {value}")
        return value

    return parse


KV_CACHE_TYPES = ("f32", "f16", "q8_0", "q4_0")


def add_compute_arguments(p: argparse.ArgumentParser) -> None:
    """-t/--threads, -c/--ctx-size, --allow-long-context, --device and --cache-type-k/-v, shared by the commands
    that run a Session (pass them on with session_kv_options(args))."""
    p.add_argument(
        "-t",
        "--threads",
        type=non_negative_int("-t"),
        default=0,
        metavar="N",
        help="compute threads (default: 0 = one per core)",
    )
    p.add_argument(
        "-c",
        "--ctx-size",
        type=non_negative_int("-c"),
        default=0,
        metavar="N",
        help="context size in tokens (default: 0 = the model's, at most 4096)",
    )
    p.add_argument(
        "--allow-long-context",
        action="store_true",
        help="accept -c beyond the model's trained context (refused otherwise; llama.cpp only warns)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the forward pass runs (cuda: the CUDA backend; a typed error when it cannot)",
    )
    for which in ("k", "v"):
        p.add_argument(
            f"-ct{which}",
            f"--cache-type-{which}",
            choices=KV_CACHE_TYPES,
            default=None,
            help=f"KV cache type for {which.upper()} (default: f16; f32 in exact mode; deepseek2's MLA latent "
            "is both K and V: give -ctk and -ctv the same type)",
        )


def session_kv_options(args) -> dict:
    """The Session keywords of add_compute_arguments' KV and context options."""
    return {
        "cache_type_k": getattr(args, "cache_type_k", None),
        "cache_type_v": getattr(args, "cache_type_v", None),
        "allow_long_context": getattr(args, "allow_long_context", False),
        "device": getattr(args, "device", "cpu"),
    }


def add_streaming_arguments(p: argparse.ArgumentParser) -> None:
    """The expert streaming, cache, predictor and tracing options of `run` and `serve`."""
    p.add_argument(
        "--ram-budget",
        default=None,
        metavar="SIZE",
        help="stream experts from the file within this much RAM, e.g. 6GiB, or auto (what the machine or its "
        "cgroup has available minus max(256 MiB, 10%%)) (default: all resident)",
    )
    p.add_argument(
        "--vram-budget",
        default=None,
        metavar="SIZE",
        help="with --device cuda: VRAM for the session, e.g. 12GiB, or auto (free VRAM minus a margin); dense "
        "weights, KV cache and buffers first, then every expert if they fit, else expert slots the experts "
        "stream into from pinned RAM (same output; `sharpi inspect --plan` shows the plan) (default: all "
        "resident)",
    )
    p.add_argument(
        "--miss-route",
        choices=["copy", "cpu", "auto"],
        default="copy",
        help="with --vram-budget, an expert missing from VRAM: copy it (default; the resident output bit for "
        "bit), compute it on the CPU, or auto (the cheaper by the miss cost model on measured bandwidths)",
    )
    p.add_argument(
        "--reader",
        choices=["auto", "cufile", "io_uring", "uring", "pread"],
        default="auto",
        help="expert reader when streaming (default: auto = io_uring where it works, else pread; with "
        "--device cuda --vram-budget: cufile = cuFile reads into the VRAM slots (GPUDirect Storage where "
        "nvidia-fs is loaded, else cuFile's POSIX path), auto = cuFile only with nvidia-fs, else copies from "
        "the pinned mapping; cufile is an error saying why where it cannot run)",
    )
    p.add_argument(
        "--slru-probation",
        type=float,
        default=0.25,
        metavar="F",
        help="share of expert slots in the SLRU probation segment (default: 0.25)",
    )
    p.add_argument(
        "--cache-policy",
        default=None,
        metavar="NAME[:FILE]",
        help="expert-cache replacement policy when streaming: lru, slru, lfu, arc, s3fifo, predictive, or "
        "prior:FILE (fitted by `sharpi cache-prior`) (default: the best on real routing, "
        "docs/cache_policies.md)",
    )
    p.add_argument(
        "--predictor",
        default="none",
        metavar="NAME[:FILE]",
        help="predictive expert prefetch while streaming: none (reactive, default), prev_token, next_gate, "
        "pregate, or cooc/learned/trajectory with a predictor file (NAME:FILE; docs/predictors.md)",
    )
    p.add_argument(
        "--lookahead",
        type=int,
        choices=[1, 2, 3],
        default=1,
        help="layers ahead the predictor prefetches for (default: 1)",
    )
    p.add_argument(
        "--prefetch-sizing",
        choices=["topk", "bytes"],
        default="topk",
        help="predicted experts read per layer: the best top_k (topk, default) or those whose expected "
        "stall saved beats a wasted read's cost (bytes; docs/predictors.md)",
    )
    p.add_argument(
        "--trace",
        default=None,
        metavar="DIR",
        help="MoE tracing (also SHARPI_TRACE_MOE=1): print per-layer hit/recall/prefetch/stall table, "
        "write DIR/moe_trace.json and a Perfetto timeline",
    )
    p.add_argument(
        "--route-trace",
        default=None,
        metavar="NPZ",
        help="make the router follow a recorded routing trace (shared/traces format; benchmarks)",
    )


def session_options(args: argparse.Namespace) -> dict:
    """sharpi.Session keyword arguments from add_compute_arguments' and add_streaming_arguments' options."""
    return {
        "threads": args.threads,
        "n_ctx": args.ctx_size,
        "ram_budget": args.ram_budget,
        "vram_budget": args.vram_budget,
        "miss_route": args.miss_route,
        "slru_probation": args.slru_probation,
        "cache_policy": args.cache_policy,
        "reader": args.reader,
        "route_trace": args.route_trace,
        "predictor": args.predictor,
        "lookahead": args.lookahead,
        "prefetch_sizing": args.prefetch_sizing,
        "trace": args.trace,
        **session_kv_options(args),
    }
