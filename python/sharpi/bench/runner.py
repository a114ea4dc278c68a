"""`sharpi bench`'s parent process: plans the runs of each workload, launches them, collects the report.

What it owns: the order of the runs (probe, sequential bandwidth, resident, a settling run when
predictors are compared, then one streamed run per round, budget share and predictor, each round's
order rotated), the budget of each (fixed bytes + n_slots x slot), the memory cap and
cache drop around each, and the output files under --out (bench.txt, bench.json, timeline.json,
bench-WORKLOAD.png).
It only plans, launches and summarises: runs happen in workers (bench.isolation, bench.worker), the
numbers come from bench.report.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..progress import bar
from ..progress import write as progress_write
from .arguments import DESCRIPTION, add_arguments, resolve_options
from .isolation import GiB, MemoryCap, drop_page_cache, launch
from .plots import write_plots
from .predictors import prepare_predictors
from .report import (
    GOAL_RATIO,
    compare_predictors,
    fmt,
    format_report,
    json_default,
    round_summary,
    summarise_resident,
    summarise_stream,
)
from .worker import run_worker
from .workloads import (
    QUICK_TRACE_OVERRIDES,
    TRACE_PRESET,
    ensure_model,
    eval_split,
    expert_layout,
    measure_sequential_bandwidth,
    trace_rows,
)


class StreamLaunch(NamedTuple):
    """What one streamed run was given (slots, budget bytes, worker config, memory cap, page-cache
    drop) and what its worker returned (res)."""

    n_slots: int
    budget: int
    cfg: dict
    res: dict
    cap: MemoryCap
    cache_drop: str


def run_workload(
    name: str,
    model: dict,
    opts: dict,
    trace_rows: np.ndarray | None,
    timeline_path: Path | None,
    log,
    trace_path: Path | None = None,
) -> dict:
    """Probe, bandwidth, resident and one streamed run per budget and predictor for one model.
    trace_path: the recorded trace whose train split trains this workload's sidecar predictors
    (None: train them on a trace harvested from the model)."""
    path = model["path"]
    work = opts["out"] / "work"
    n_ctx = opts["warmup"] + opts["tokens"] + 16
    base = {"path": path, "threads": opts["threads"], "n_ctx": n_ctx, "reader": opts["reader"],
            "cache_policy": opts.get("cache_policy")}  # fmt: skip
    w: dict = {"name": name, "model": dict(model)}

    probe = launch(
        {**base, "mode": "probe", "budget_bytes": os.path.getsize(path) + GiB}, work, f"{name}-probe"
    )
    if not probe["ok"]:
        raise RuntimeError(f"{name}: probe failed: {probe['error']}")
    info = probe["info"]
    # n_layer counts the MoE layers (the ones with experts to stream; deepseek2's first is dense).
    n_layer = info["n_layer"] - info.get("n_layer_dense_lead", 0)
    n_expert, k = info["n_expert"], info["n_expert_used"]
    layout = expert_layout(path)
    w["model"].update(
        {
            "arch": info["arch"],
            "file_bytes": os.path.getsize(path),
            "n_layer": n_layer,
            "n_expert": n_expert,
            "n_expert_used": k,
            "n_vocab": info["n_vocab"],
            "bytes_dense": info["bytes_dense"],
            "bytes_experts": info["bytes_experts"],
            "expert_bytes_per_layer": layout["expert_bytes"],
            "fixed_bytes": probe["fixed_bytes"],
            "slot_bytes": probe["slot_bytes"],
            "reader": probe["reader"],
            "n_ctx": n_ctx,
        }
    )
    kind = "uring" if probe["reader"] == "io_uring" else "pread"
    bw = measure_sequential_bandwidth(path, kind, layout, opts["bw_bytes"], opts["drop_cache"])
    w["sequential_read"] = bw
    log(
        f"{name}: {probe['reader']} sequential read {bw['gbps']:.2f} GB/s ({bw['bytes'] / GiB:.2f} GiB, {bw['cache_drop']})"
    )

    rng = np.random.default_rng(opts["seed"])
    tokens = [int(t) for t in rng.integers(1, info["n_vocab"], size=opts["warmup"] + opts["tokens"])]
    base.update({"tokens": tokens, "warmup": opts["warmup"]})
    if trace_rows is not None:
        rows_path = work / f"{name}-replayed-rows.npy"
        np.save(rows_path, trace_rows)
        base["trace_rows"] = str(rows_path)

    cache_drop = drop_page_cache([path], opts["drop_cache"])
    res = launch({**base, "mode": "resident"}, work, f"{name}-resident")
    if not res["ok"]:
        raise RuntimeError(f"{name}: resident run failed: {res['error']}")
    resident = summarise_resident(res)
    resident["cache_drop"] = cache_drop
    w["resident"] = resident
    log(f"{name}: resident TPOT {resident['tpot_ms']:.1f} ms (cold pass {resident['cold_tpot_ms']:.1f} ms)")

    plan = {"runs": [("none", None)], "skipped": {}, "sidecars": {}}
    if len(opts["predictors"]) > 1:
        plan = prepare_predictors(name, path, info, opts, work, log, trace=trace_path)
        for pred, why in plan["skipped"].items():
            log(f"{name}: predictor {pred} skipped: {why}")
    w["predictors"] = {
        "lookahead": opts["lookahead"],
        "prefetch_sizing": opts["prefetch_sizing"],
        "runs": [p for p, _ in plan["runs"]],
        "skipped": plan["skipped"],
        "sidecars": plan["sidecars"],
        "train_trace": plan.get("train_trace"),
    }

    total = n_layer * n_expert
    runs = []
    rounds = int(opts.get("rounds", 1))
    configs = [
        (rnd, share, pred, sidecar)
        for rnd in range(rounds)
        for share in opts["budgets"]
        for pred, sidecar in rotated(plan["runs"], rnd)
    ]

    def launch_stream(share: float, pred: str, sidecar, label: str, timeline: bool) -> StreamLaunch:
        """One streamed run in a worker under its memory cap, the page cache dropped first."""
        n_slots = min(total, max(k, round(share * total)))
        budget = probe["fixed_bytes"] + n_slots * probe["slot_bytes"]
        cfg = {**base, "mode": "stream", "budget_bytes": budget, "n_slots": n_slots, "predictor": pred}
        if pred != "none":
            cfg.update({"lookahead": opts["lookahead"], "predictor_file": sidecar,
                        "prefetch_sizing": opts["prefetch_sizing"]})
        if timeline:
            cfg["timeline_path"] = str(timeline_path)
            cfg["timeline_tokens"] = opts["timeline_tokens"]
        with MemoryCap(budget + opts["cap_overhead"], enabled=opts["cap"]) as cap:
            cache_drop = drop_page_cache([path], opts["drop_cache"])
            res = launch(cfg, work, label, cap)
        return StreamLaunch(n_slots, budget, cfg, res, cap, cache_drop)

    if configs and (rounds > 1 or len(plan["runs"]) > 1):
        # A settling run, not recorded: on the development machine the first streamed run after the
        # resident one was often far slower than its repeats, for a cause not found (the numbers:
        # docs/predictors.md, "Why the settling run"). So that no compared configuration pays for
        # it, the first one runs once before the measured ones.
        _, share0, pred0, sidecar0 = configs[0]
        res = launch_stream(share0, pred0, sidecar0, f"{name}-settle", False).res
        settle = {"predictor": pred0, "share": share0, "ok": bool(res["ok"])}
        if res["ok"]:
            settle["tpot_ms"] = 1e3 * float(np.mean(res["step_s"]))
        w["settle_run"] = settle
        log(f"{name}: settling run ({pred0}, not recorded): " + (
            f"TPOT {settle['tpot_ms']:.1f} ms" if res["ok"] else f"failed: {res['error']}"))
    for rnd, share, pred, sidecar in bar(configs, desc=f"{name}: streamed runs", unit="run"):
        label = f"{name}-{share:g}" if pred == "none" else f"{name}-{share:g}-{pred}"
        if rounds > 1:
            label += f"-round{rnd}"
        load_before = os.getloadavg()[0]
        timeline = timeline_path is not None and rnd == 0 and share == opts["budgets"][0] and pred == "none"
        launched = launch_stream(share, pred, sidecar, label, timeline)
        res, cfg, cap = launched.res, launched.cfg, launched.cap
        head = {"share": share, "predictor": pred, "round": rnd, "n_slots": launched.n_slots,
                "budget_bytes": launched.budget}  # fmt: skip
        if not res["ok"]:
            log(f"{label}: FAILED: {res['error']}")
            runs.append({**head, "cap": cap.report(), "error": res["error"]})
            continue
        res.update({"predictor": pred, "lookahead": cfg.get("lookahead"), "predictor_file": sidecar,
                    "prefetch_sizing": cfg.get("prefetch_sizing")})
        r = summarise_stream(res, n_layer, n_expert, layout["expert_bytes"], bw["gbps"], resident)
        r["share"] = share
        r["round"] = rnd
        r["loadavg_1min"] = load_before
        r["cap"] = cap.report()
        r["cache_drop"] = launched.cache_drop
        if "timeline" in res:
            w["timeline"] = res["timeline"]
        runs.append(r)
        log(
            f"{label}: TPOT {r['tpot_ms']:.1f} ms, hit {r['hit_rate']:.3f}, stall {r['stall_fraction']:.2f}, "
            f"recall@k {fmt(r['recall_at_k'], '.3f')}, LB {fmt(r['lower_bound_ms_per_token'], '.1f')} ms, "
            f"cap {'on' if r['cap']['applied'] else 'off'}"
        )
    w["runs"] = runs
    w["round_summary"] = round_summary(runs)  # read by the report and the plots, never recomputed
    w["predictor_comparison"] = compare_predictors(w["round_summary"]) if len(plan["runs"]) > 1 else []
    return w


def rotated(runs: list, rnd: int) -> list:
    """The runs of one budget in round rnd: the plan's order rotated left by rnd, so that over
    len(runs) rounds each of them (none included) runs once in every position. Why: a fixed order
    charges whatever depends on position to one predictor; on the development machine the first
    streamed run after the resident one (always none before --rounds) was the slowest of most
    invocations, for a reason not found (docs/predictors.md)."""
    k = rnd % len(runs) if runs else 0
    return list(runs[k:]) + list(runs[:k])


def run(args: argparse.Namespace) -> int:
    """`sharpi bench`: returns the exit status (0 even when the goal is not met; 1 when a run failed)."""
    t_start = time.perf_counter()
    opts = resolve_options(args)
    out = opts["out"]
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        progress_write(f"[bench] {msg}")  # above the runs' bar (sharpi.progress)

    doc: dict = {
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_start": os.getloadavg(),
        },
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in opts.items()},
        "goal_ratio": GOAL_RATIO,
        "workloads": [],
    }
    timeline_path = out / "timeline.json"
    timeline_path.unlink(missing_ok=True)

    if opts["random"]:
        main_model = ensure_model(opts["model_dir"], opts["preset"], opts["quant"], opts["seed"], {}, log)
        main_model.update({"preset": opts["preset"], "quant": opts["quant"]})
        doc["workloads"].append(run_workload("random", main_model, opts, None, timeline_path, log))
    else:
        doc["workloads"].append({"name": "random", "skipped": "--no-random given"})

    if opts["trace"] is None:
        log(f"trace replay skipped: {opts['trace_skip']}")
        doc["workloads"].append({"name": "trace", "skipped": opts["trace_skip"]})
    else:
        overrides = QUICK_TRACE_OVERRIDES if opts["quick"] else {}
        tm = ensure_model(opts["model_dir"], TRACE_PRESET, opts["quant"], opts["seed"], overrides, log)
        tm.update({"preset": TRACE_PRESET, "quant": opts["quant"], "overrides": overrides})
        from .. import presets

        trace_hp = presets.resolve(None, TRACE_PRESET, **overrides)
        n_layer = trace_hp.n_layer - trace_hp.n_layer_dense_lead  # the trace records MoE layers only
        with np.load(opts["trace"]) as z:
            n_train_seq, eval_start = eval_split(z["seq_start"], z["experts"].shape[0])
        start = eval_start if opts["trace_start"] is None else opts["trace_start"]
        rows, note = trace_rows(opts["trace"], start, opts["warmup"] + opts["tokens"], n_layer)
        if start >= eval_start:
            note += f"; evaluation split: sequences {n_train_seq}.. (rows {eval_start}..)"
        else:
            note += f"; NOTE: rows before {eval_start} belong to the split predictors are trained on"
        w = run_workload("trace", tm, opts, rows, None, log, trace_path=opts["trace"])
        w["trace"] = f"{opts['trace']} ({note})"
        w["trace_rows_start"] = start
        doc["workloads"].append(w)

    tl = next((w["timeline"] for w in doc["workloads"] if "timeline" in w), None)
    doc["timeline"] = tl or {"note": "no timeline recorded"}
    doc["wall_s"] = time.perf_counter() - t_start
    doc["machine"]["loadavg_end"] = os.getloadavg()
    text = format_report(doc)
    sys.stdout.write(text)
    (out / "bench.txt").write_text(text)
    plots, no_plots = write_plots(doc, out)
    doc["plots"] = [str(p) for p in plots] if plots else {"note": no_plots}
    with open(out / "bench.json", "w") as f:
        json.dump(doc, f, indent=1, default=json_default)
    log(f"wrote {out / 'bench.json'} and {out / 'bench.txt'}")
    log(f"plots: {', '.join(str(p) for p in plots)}" if plots else f"plots not written: {no_plots}")
    failed = any("error" in r for w in doc["workloads"] for r in w.get("runs", []))
    return 1 if failed else 0


def main(argv: list | None = None) -> int:
    """`python -m sharpi.bench [OPTIONS]` (the bench) or `... --worker CONFIG RESULT` (one worker run)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        if len(argv) != 3:
            print("usage: python -m sharpi.bench --worker CONFIG.json RESULT.json", file=sys.stderr)
            return 2
        return run_worker(argv[1], argv[2])
    p = argparse.ArgumentParser(prog="sharpi bench", description=DESCRIPTION)
    add_arguments(p)
    return run(p.parse_args(argv))
