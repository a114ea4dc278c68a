"""The numbers `sharpi bench` reports: per run metrics, Belady / LRU bounds, verdicts, predictor
comparison, and the table and JSON they are written as.

What it owns: turning a worker's raw result (step times, routing, the engine's counters) into the
fields of bench.json (RUN_FIELDS), with the cache / prefetch / predictor metrics derived by
sharpi.metrics and the replacement bounds simulated by sharpi.belady; the verdict in words; the
human table (bench.txt). Pure arithmetic and formatting on plain dicts: it launches nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import metrics
from .isolation import GiB, MiB

GOAL_RATIO = 1.5  # TPOT / IO lower bound a reactive engine should reach (issue 3, item 5)
RANDOM_ROUTING_NOTE = (
    "Synthetic random-weight models route unlike trained ones: their routers pick near-uniform, "
    "weakly correlated experts (docs/design.md §6: layer-ahead recall@2 0.35-0.51 on random weights vs "
    "0.55-0.83 trained; previous-token reuse 0.55-0.77 vs 0.34-0.46), so predictor rankings on the random "
    "workload say nothing about real models; judge predictors on the trace-replay workload."
)

# Fields of every streamed run in bench.json (tests/test_bench.py checks them). The engine's
# counters keep sharpi.metrics' names (summed over layers); the rest are the bench's own.
RUN_FIELDS = (
    # the run
    "share",
    "n_slots",
    "budget_bytes",
    "cap",
    "cache_drop",
    "reader",
    "tokens",
    "warmup_tokens",
    # time
    "decode_s",
    "tpot_ms",
    "tpot_p50_ms",
    "decode_tok_s",
    "cpu_ms_per_token",
    # the expert cache
    *metrics.CACHE_COUNTERS,
    "hit_rate",
    "bytes_per_token",
    "stall_fraction",
    "io_gbps_wall",
    "io_gbps_stall",
    "peak_rss_bytes",
    "major_faults_per_token",
    # the bounds and the verdict
    "belady_misses",
    "belady_bytes",
    "belady_hit_rate",
    "lru_misses",
    "lru_hit_rate",
    "lower_bound_ms_per_token",
    "ratio_tpot_to_lower_bound",
    "ratio_tpot_to_lower_bound_plus_resident",
    "goal_met",
    "verdict",
    "engine_misses_at_least_belady",
    "output_matches_resident",
    "layers",
    # prediction and prefetch
    "predictor",
    "lookahead",
    "prefetch_sizing",
    "n_staging",
    "recall_at_k",
    "precision",
    *metrics.PREFETCH_COUNTERS,
    "predict_ms",
    "predict_overhead",
    "overlap",
)


def summarise_stream(
    res: dict, n_layer: int, n_expert: int, expert_bytes: list, seq_gbps: float, resident: dict
) -> dict:
    """The numbers of one streamed run, its Belady / LRU simulation and its ratios."""
    from ..belady import belady, lru, steps_from_routing

    steps = res["step_s"]
    n_tok = len(steps)
    decode_s = float(sum(steps))
    layers = res["layers"]
    cache = metrics.sum_layers(layers, metrics.CACHE_COUNTERS)
    accesses, hits, misses = cache["accesses"], cache["hits"], cache["misses"]
    bytes_read, stall_ms = cache["bytes_read"], cache["stall_ms"]
    n_slots = res["n_slots"]
    n_staging = int(res.get("n_staging", 0))
    predictor = res.get("predictor", "none")

    warm_steps = steps_from_routing(res["warm_routing"], n_expert)
    dec_steps = steps_from_routing(res["routing"], n_expert)
    warm_set = set().union(*warm_steps) if warm_steps else set()
    # The policies get every slot of the budget (cache + staging): the bound of any reactive engine
    # with the same RAM, so predictor runs are compared with the same bound as the baseline.
    opt = belady(dec_steps, n_slots + n_staging, warm=warm_set)
    ref = lru(warm_steps + dec_steps, n_slots + n_staging, count_from=len(warm_steps))
    # Step j of the decode sequence is layer j % n_layer; a miss there costs that layer's expert bytes.
    opt_bytes = sum(m * expert_bytes[j % n_layer] for j, m in enumerate(opt.misses_per_step))
    lb_ms = opt_bytes / (seq_gbps * 1e9) * 1e3 / n_tok if seq_gbps > 0 else None

    tpot_ms = decode_s * 1e3 / n_tok
    res_tpot = resident.get("tpot_ms")
    ratio_lb = tpot_ms / lb_ms if lb_ms else None
    ratio_both = tpot_ms / (lb_ms + res_tpot) if lb_ms is not None and res_tpot else None
    goal_met = ratio_lb is not None and ratio_lb <= GOAL_RATIO
    out = {
        "share": None,  # filled by the caller
        "n_slots": n_slots,
        "budget_bytes": res["budget_bytes"],
        "reader": res["reader"],
        "tokens": n_tok,
        "warmup_tokens": len(res["warm_routing"]),
        "decode_s": decode_s,
        "tpot_ms": tpot_ms,
        "tpot_p50_ms": float(np.median(steps)) * 1e3,
        "decode_tok_s": n_tok / decode_s,
        "cpu_ms_per_token": float(sum(res["cpu_s"])) * 1e3 / n_tok,
        "accesses": accesses,
        "hits": hits,
        "misses": misses,
        "evictions": cache["evictions"],
        "hit_rate": metrics.hit_rate(hits, accesses) or 0.0,
        "bytes_read": bytes_read,
        "bytes_per_token": bytes_read / n_tok,
        "stall_ms": stall_ms,
        "stall_fraction": stall_ms / 1e3 / decode_s,
        "io_gbps_wall": metrics.gbps(bytes_read, decode_s),
        "io_gbps_stall": metrics.gbps(bytes_read, stall_ms / 1e3),
        "peak_rss_bytes": res.get("peak_rss_bytes"),
        "major_faults_per_token": res["major_faults"] / n_tok if "major_faults" in res else None,
        "belady_misses": opt.misses,
        "belady_bytes": opt_bytes,
        "belady_hit_rate": opt.hit_rate,
        "lru_misses": ref.misses,
        "lru_hit_rate": ref.hit_rate,
        "lower_bound_ms_per_token": lb_ms,
        "ratio_tpot_to_lower_bound": ratio_lb,
        "ratio_tpot_to_lower_bound_plus_resident": ratio_both,
        "goal_met": goal_met,
        # Sanity: a demand cache can never miss less than Belady from the same warm-up (a prefetching
        # one can: its reads ahead turn demand misses into hits, so no check there).
        "engine_misses_at_least_belady": misses >= opt.misses if predictor == "none" else None,
        # Lossless invariant: streamed logits are bit-identical to the resident engine's.
        "output_matches_resident": (
            res["logits_sha256"] == resident.get("logits_sha256") if resident.get("logits_sha256") else None
        ),
        "layers": layers,
    }
    out.update(predictor_metrics(res, decode_s, predictor, n_staging, n_tok))
    out["verdict"] = verdict(out, resident, seq_gbps)
    return out


def predictor_metrics(res: dict, decode_s: float, predictor: str, n_staging: int, n_tok: int) -> dict:
    """The docs/design.md §7 prediction / prefetch metrics of one run (sharpi.metrics' arithmetic).
    predict_overhead = predict_ms / decode_ms: the engine's decode_ms when it reports one, else the
    bench's measured decode wall time."""
    stats = dict(res.get("stats_globals", {}))
    stats["layers"] = res["layers"]
    total = metrics.summarise(stats, top_k=res["info"]["n_expert_used"])["total"]
    decode_ms = total["decode_ms"] or decode_s * 1e3
    out = {
        "predictor": predictor,
        "lookahead": res.get("lookahead"),
        "prefetch_sizing": res.get("prefetch_sizing"),
        "predictor_file": res.get("predictor_file"),
        "n_staging": n_staging,
        "recall_at_k": total["recall_at_k"],
        "precision": total["precision"],
    }
    out.update({key: total[key] for key in metrics.PREFETCH_COUNTERS})
    out["prefetch_wasted_bytes_per_token"] = total["prefetch_wasted_bytes"] / n_tok
    out["predict_ms"] = total["predict_ms"]
    out["predict_overhead"] = metrics.predict_overhead(total["predict_ms"], decode_ms)
    out["overlap"] = total["overlap"]
    out["io_busy_ms"] = total["io_busy_ms"] or None
    return out


def verdict(r: dict, resident: dict, seq_gbps: float) -> str:
    """Plain words: is TPOT within GOAL_RATIO of the lower bound, and if not, where the time went."""
    resident_tpot = resident.get("tpot_ms")
    lb = r["lower_bound_ms_per_token"]
    if not lb:
        return (
            "no bound: Belady needs no reads after the warm-up, so the IO lower bound is 0; "
            "compare TPOT with the resident TPOT instead"
        )
    ratio = r["ratio_tpot_to_lower_bound"]
    if r["goal_met"]:
        return f"goal met: TPOT is {ratio:.2f}x the IO lower bound (<= {GOAL_RATIO})"
    reasons = []
    if resident_tpot and resident_tpot > GOAL_RATIO * lb:
        reasons.append(
            f"compute alone (resident TPOT {resident_tpot:.1f} ms) is {resident_tpot / lb:.2f}x the IO bound "
            f"({lb:.1f} ms, which counts no compute): no IO schedule can meet the goal on this machine"
        )
    elif resident_tpot and resident_tpot > (GOAL_RATIO - 1) * lb:
        reasons.append(
            f"compute (resident TPOT {resident_tpot:.1f} ms) exceeds the {GOAL_RATIO - 1:.1f}x slack the goal "
            f"leaves over the IO bound ({lb:.1f} ms): only reads fully hidden behind compute can meet it"
        )
    if r["belady_misses"] and r["misses"] > r["belady_misses"]:
        reasons.append(
            f"cache misses {r['misses']} vs Belady {r['belady_misses']} ({r['misses'] / r['belady_misses']:.2f}x, LRU "
            f"{r['lru_misses']}): the reactive policy reads more than the optimum"
        )
    if r["io_gbps_stall"] and r["io_gbps_stall"] < 0.8 * seq_gbps:
        reasons.append(
            f"reads ran at {r['io_gbps_stall']:.2f} GB/s while compute waited vs {seq_gbps:.2f} GB/s sequential "
            "(demand reads of one layer's missing experts at a time, no prefetch)"
        )
    if r["stall_fraction"] < 0.5:
        busy_ms = r["tpot_ms"] * (1 - r["stall_fraction"])
        text = f"only {r['stall_fraction']:.0%} of decode time is stall: compute dominates"
        if resident_tpot and busy_ms > 1.1 * resident_tpot:
            text += (
                f" (time not stalled {busy_ms:.0f} ms/token = {busy_ms / resident_tpot:.2f}x the resident TPOT; "
                f"CPU {r['cpu_ms_per_token']:.0f} vs {resident['cpu_ms_per_token']:.0f} ms/token resident: "
                "the excess is streaming's own CPU work or other load on the cores)"
            )
        elif resident_tpot:
            text += f" (time not stalled {busy_ms:.0f} ms/token, resident TPOT {resident_tpot:.0f} ms)"
        reasons.append(text)
    if not reasons:
        reasons.append("no single cause stands out in the counters")
    return f"goal NOT met: TPOT is {ratio:.2f}x the IO lower bound (> {GOAL_RATIO}); " + "; ".join(reasons)


def summarise_resident(res: dict) -> dict:
    steps = res["step_s"]
    return {
        "tokens": len(steps),
        "decode_s": float(sum(steps)),
        "tpot_ms": float(sum(steps)) * 1e3 / len(steps),
        "tpot_p50_ms": float(np.median(steps)) * 1e3,
        "decode_tok_s": len(steps) / float(sum(steps)),
        "cpu_ms_per_token": float(sum(res["cpu_s"])) * 1e3 / len(steps),
        "cold_tpot_ms": float(sum(res["cold_step_s"])) * 1e3 / len(steps),
        "peak_rss_bytes": res.get("peak_rss_bytes"),
        "logits_sha256": res["logits_sha256"],
    }


def _stall_per_token(r: dict) -> float:
    return r["stall_ms"] / r["tokens"]


def round_summary(runs: list) -> list:
    """Per (share, predictor), in the order they first ran: the medians over the rounds that finished
    (a single run is its own median) and, for a predictor, its stall cut against the none run of the
    same share and round, per round and the median of those. The cut is taken within a round because
    rounds differ more than runs inside one (the disk's rate drifts over minutes)."""
    done = [r for r in runs if "tpot_ms" in r]
    none_stall = {
        (r["share"], r.get("round", 0)): _stall_per_token(r) for r in done if r.get("predictor", "none") == "none"
    }
    groups: dict = {}
    for r in done:
        groups.setdefault((r["share"], r.get("predictor", "none")), []).append(r)
    out = []
    for (share, pred), rs in groups.items():
        cuts = []
        if pred != "none":
            for r in rs:
                base = none_stall.get((share, r.get("round", 0)))
                if base is not None and base > 0:
                    cuts.append(1 - _stall_per_token(r) / base)
        hits = [r["hit_rate"] for r in rs if r.get("hit_rate") is not None]
        faults = [r["major_faults_per_token"] for r in rs if r.get("major_faults_per_token") is not None]
        read = [r["bytes_per_token"] for r in rs if r.get("bytes_per_token")]
        wasted = [r.get("prefetch_wasted_bytes_per_token", 0.0) / r["bytes_per_token"] for r in rs
                  if r.get("bytes_per_token")]  # fmt: skip
        out.append(
            {
                "share": share,
                "predictor": pred,
                "rounds": len(rs),
                "tpot_ms": float(np.median([r["tpot_ms"] for r in rs])),
                "stall_ms_per_token": float(np.median([_stall_per_token(r) for r in rs])),
                "hit_rate": float(np.median(hits)) if hits else None,
                "bytes_per_token": float(np.median(read)) if read else None,
                "wasted_fraction": float(np.median(wasted)) if wasted else None,
                "major_faults_per_token": float(np.median(faults)) if faults else None,
                "stall_cuts": cuts,
                "stall_cut": float(np.median(cuts)) if cuts else None,
            }
        )
    return out


def compare_predictors(summary: list) -> list:
    """Per budget share of round_summary(runs): the best predictor, by median stall time per token
    over the rounds, against the baseline (predictor none) of the same share. stall_reduction: the
    median over rounds of 1 - best / none within each round (with one round, 1 - best / none)."""
    out = []
    for share in dict.fromkeys(s["share"] for s in summary):
        same = [s for s in summary if s["share"] == share]
        base = next((s for s in same if s["predictor"] == "none"), None)
        others = [s for s in same if s["predictor"] != "none"]
        if base is None or not others:
            continue
        best = min(others, key=lambda s: s["stall_ms_per_token"])
        out.append(
            {
                "share": share,
                "best": best["predictor"],
                "rounds": best["rounds"],
                "stall_ms_per_token_none": base["stall_ms_per_token"],
                "stall_ms_per_token_best": best["stall_ms_per_token"],
                "stall_reduction": best["stall_cut"] if base["stall_ms_per_token"] > 0 else None,
                "tpot_ms_none": base["tpot_ms"],
                "tpot_ms_best": best["tpot_ms"],
                "tpot_speedup": base["tpot_ms"] / best["tpot_ms"],
            }
        )
    return out


def fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def format_predictors(w: dict) -> list:
    """The predictor axis of one workload: a row per (share, predictor), the best vs none per share,
    sidecars used and predictors skipped."""
    pw = w["predictors"]
    lines = [
        (
            f"  predictors (lookahead {pw['lookahead']}, sets sized by {pw.get('prefetch_sizing', 'topk')}; recall@k and precision over the prediction sets the "
            "engine scored; wasted: prefetched, never used; overhead: predict_ms / decode_ms):"
        )
    ]
    n_rounds = len({r.get("round", 0) for r in w["runs"]})
    lines.append(
        f"  {'share':>5} {'predictor':>10} {'TPOT ms':>8} {'stall':>5} {'stall ms/t':>10} {'hit':>5} "
        f"{'recall@k':>8} {'prec':>5} {'issued':>7} {'used':>6} {'late':>5} {'skipped':>7} {'waste MB/t':>10} "
        f"{'overhead':>8} {'lossless':>8} {'majflt/t':>8}" + (f" {'round':>5}" if n_rounds > 1 else "")
    )
    for r in w["runs"]:
        pred = r.get("predictor", "none")
        rnd = f" {r.get('round', 0):>5}" if n_rounds > 1 else ""
        if "tpot_ms" not in r:
            why = r.get("skipped") or r.get("error")
            lines.append(
                f"  {r['share']:>5.0%} {pred:>10}  {'skipped' if 'skipped' in r else 'FAILED'}{rnd}: {why}"
            )
            continue
        lossless = {True: "yes", False: "NO", None: "-"}[r["output_matches_resident"]]
        lines.append(
            f"  {r['share']:>5.0%} {pred:>10} {r['tpot_ms']:>8.1f} {r['stall_fraction']:>5.2f} "
            f"{r['stall_ms'] / r['tokens']:>10.1f} {r['hit_rate']:>5.3f} {fmt(r['recall_at_k'], '.3f'):>8} "
            f"{fmt(r['precision'], '.2f'):>5} {r['prefetch_issued']:>7.0f} {r['prefetch_used']:>6.0f} "
            f"{r['prefetch_late']:>5.0f} {r['prefetch_skipped']:>7.0f} "
            f"{r['prefetch_wasted_bytes_per_token'] / 1e6:>10.2f} "
            f"{fmt(r['predict_overhead'] and r['predict_overhead'] * 100, '.2f'):>7}% {lossless:>8} "
            f"{fmt(r.get('major_faults_per_token'), '.1f'):>8}{rnd}"
        )
    if n_rounds > 1:
        lines.append(
            f"  medians over {n_rounds} rounds (order rotated each round); stall cut: against the none run "
            "of the same round, the median and each round's:"
        )
        lines.append(
            f"  {'share':>5} {'predictor':>10} {'runs':>4} {'TPOT ms':>8} {'stall ms/t':>10} {'hit':>5} "
            f"{'MB/t':>6} {'wasted':>6} {'majflt/t':>8} {'stall cut':>9}  per round"
        )
        for m in w["round_summary"]:
            per_round = ", ".join(format(c, "+.1%") for c in m["stall_cuts"])
            lines.append(
                f"  {m['share']:>5.0%} {m['predictor']:>10} {m['rounds']:>4} {m['tpot_ms']:>8.1f} "
                f"{m['stall_ms_per_token']:>10.1f} {fmt(m['hit_rate'], '.3f'):>5} "
                f"{fmt(m['bytes_per_token'] and m['bytes_per_token'] / 1e6, '.0f'):>6} "
                f"{fmt(m['wasted_fraction'] and m['wasted_fraction'] * 100, '.1f'):>5}% "
                f"{fmt(m['major_faults_per_token'], '.1f'):>8} "
                f"{fmt(m['stall_cut'], '+.1%'):>9}  {per_round}"
            )
    for c in w.get("predictor_comparison", []):
        red = c["stall_reduction"]
        over = f" (medians of {c['rounds']} rounds)" if c.get("rounds", 1) > 1 else ""
        lines.append(
            f"  {c['share']:.0%}: best predictor {c['best']}{over}: stall {c['stall_ms_per_token_best']:.1f} vs "
            f"{c['stall_ms_per_token_none']:.1f} ms/token without prediction "
            f"({'reduction ' + format(red, '.0%') if red is not None else 'no stall to reduce'}), "
            f"TPOT {c['tpot_ms_best']:.1f} vs {c['tpot_ms_none']:.1f} ms ({c['tpot_speedup']:.2f}x)"
        )
    for name, sc in pw["sidecars"].items():
        lines.append(f"  sidecar {name}: {sc['path']} ({sc['how']})")
    if pw.get("train_trace"):
        tt = pw["train_trace"]
        lines.append(f"  sidecars trained on {tt['tokens']} tokens: {tt.get('source', tt.get('path'))}")
    for name, why in pw["skipped"].items():
        lines.append(f"  {name} not run: {why}")
    if w["name"] == "random":
        lines.append("  " + RANDOM_ROUTING_NOTE)
    return lines


def format_report(doc: dict) -> str:
    lines = []
    for w in doc["workloads"]:
        if "skipped" in w:
            lines.append(f"[{w['name']}] skipped: {w['skipped']}")
            lines.append("")
            continue
        m, bw, res = w["model"], w["sequential_read"], w["resident"]
        lines.append(
            f"[{w['name']}] {m['preset']} {m['quant']} ({m['arch']}, {m['n_layer']} layers x {m['n_expert']} experts, "
            f"top-{m['n_expert_used']}, {m['file_bytes'] / GiB:.2f} GiB; expert {np.mean(m['expert_bytes_per_layer']) / MiB:.2f} MiB, "
            f"slot {m['slot_bytes'] / MiB:.2f} MiB, fixed {m['fixed_bytes'] / GiB:.2f} GiB)"
            + (f", replaying {w['trace']}" if w.get("trace") else "")
        )
        lines.append(
            f"  reader {m['reader']}: sequential {bw['gbps']:.2f} GB/s | resident TPOT {res['tpot_ms']:.1f} ms "
            f"({res['decode_tok_s']:.2f} tok/s, CPU {res['cpu_ms_per_token']:.0f} ms/token; cold pass "
            f"{res['cold_tpot_ms']:.1f} ms) | "
            f"{w['runs'][0]['tokens'] if w['runs'] and 'tokens' in w['runs'][0] else '-'} tokens after a warm-up, page cache: {res['cache_drop']}"
        )
        head = (
            f"  {'share':>5} {'slots':>6} {'budget':>8} {'cap':>9} {'TPOT ms':>8} {'tok/s':>6} {'CPU ms':>6} {'hit':>5} "
            f"{'Belady':>6} {'LRU':>5} {'stall':>5} {'GB/s wall':>9} {'GB/s stall':>10} {'MB/tok':>7} "
            f"{'LB ms':>7} {'TPOT/LB':>7} {'/(LB+res)':>9} {'RSS':>7}"
        )
        baseline_runs = [r for r in w["runs"] if r.get("predictor", "none") == "none"]
        several_rounds = len({r.get("round", 0) for r in baseline_runs}) > 1
        lines.append(head + (f" {'round':>5}" if several_rounds else ""))
        for r in baseline_runs:
            rnd = f" {r.get('round', 0):>5}" if several_rounds else ""
            cap = r["cap"]
            cap_s = f"{cap['limit_bytes'] / GiB:.2f}G" if cap["applied"] else "none"
            if "error" in r:
                lines.append(
                    f"  {r['share']:>5.0%} {r['n_slots']:>6} {r['budget_bytes'] / GiB:>7.2f}G {cap_s:>9}  FAILED{rnd}: {r['error']}"
                )
                continue
            lines.append(
                f"  {r['share']:>5.0%} {r['n_slots']:>6} {r['budget_bytes'] / GiB:>7.2f}G {cap_s:>9} "
                f"{r['tpot_ms']:>8.1f} {r['decode_tok_s']:>6.2f} {r['cpu_ms_per_token']:>6.0f} {r['hit_rate']:>5.3f} "
                f"{r['belady_hit_rate']:>6.3f} "
                f"{r['lru_hit_rate']:>5.3f} {r['stall_fraction']:>5.2f} {r['io_gbps_wall']:>9.2f} "
                f"{fmt(r['io_gbps_stall'], '.2f'):>10} {r['bytes_per_token'] / 1e6:>7.1f} "
                f"{fmt(r['lower_bound_ms_per_token'], '.1f'):>7} {fmt(r['ratio_tpot_to_lower_bound'], '.2f'):>7} "
                f"{fmt(r['ratio_tpot_to_lower_bound_plus_resident'], '.2f'):>9} "
                f"{fmt(r['peak_rss_bytes'] and r['peak_rss_bytes'] / GiB, '.2f'):>6}G{rnd}"
            )
        for r in baseline_runs:
            if "verdict" in r:
                lines.append(f"  {r['share']:.0%}{' round ' + str(r.get('round', 0)) if several_rounds else ''}: {r['verdict']}")
                checks = []
                if not r["engine_misses_at_least_belady"]:
                    checks.append("engine missed less than Belady (impossible: check the recorded routing)")
                if r["output_matches_resident"] is False:
                    checks.append("logits differ from the resident engine (lossless invariant broken)")
                if r["cap"].get("failcnt"):
                    checks.append(f"the cap was reached {r['cap']['failcnt']} times (page cache reclaimed)")
                if checks:
                    lines.append("       " + "; ".join(checks))
        if len(w.get("predictors", {}).get("runs", [])) > 1 or w.get("predictors", {}).get("skipped"):
            lines += format_predictors(w)
        lines.append("")
    lines.append(
        "CPU ms: process CPU time per token (all threads; below threads x TPOT when the cores are shared or "
        "idle). hit / Belady / LRU: hit rates of the engine's cache (--cache-policy) and of the two policies "
        "simulated on the same accesses. stall: stall time / decode time. GB/s wall: bytes read / decode "
        "time; GB/s stall: bytes read / stall time (above the disk's rate when reads overlap compute). LB: "
        "Belady's bytes / "
        "sequential GB/s, per token. res: resident TPOT. RSS: worker peak RSS."
    )
    mach = doc["machine"]
    lines.append(
        f"machine: {mach['cpus']} CPUs, load average {mach['loadavg_start'][0]:.1f} at start, "
        f"{mach.get('loadavg_end', [float('nan')])[0]:.1f} at end"
    )
    t = doc.get("timeline") or {}
    if t.get("path"):
        lines.append(
            f"timeline: {t['path']} ({t['n_events']} spans, lanes: {', '.join(t['lanes'][:6])}{', ...' if len(t['lanes']) > 6 else ''})"
        )
    elif t.get("note"):
        lines.append(f"timeline: {t['note']}")
    lines.append(f"wall time {doc['wall_s']:.0f} s")
    return "\n".join(lines) + "\n"


def json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
