"""`sharpi bench`'s plots: one PNG per workload beside bench.txt, drawn from bench.json's numbers.

What it owns: the figures and their files. Per workload, side by side: TPOT against the budget share
with the resident TPOT and the IO lower bound (+ resident) it is judged against; the engine's hit
rate with Belady's and LRU's on the same accesses; and, when predictors ran, stall ms per token of
each predictor per share. The numbers are report.py's, unchanged; this module only draws them.

matplotlib is optional (the `plots` extra): without it write_plots() writes nothing and says how to
get it. It uses matplotlib's object API on the Agg canvas, never pyplot, so it changes no global
state and needs no display.
"""

from __future__ import annotations

from pathlib import Path

MISSING_MATPLOTLIB = "matplotlib is not installed: pip install 'sharpi[plots]' to get bench-*.png beside bench.txt"
PANEL_INCHES = (4.0, 3.4)  # one panel; a figure is a row of them
DPI = 100


def completed_baseline(w: dict) -> list:
    """The workload's runs without a predictor that finished, one per share in share order: with
    several rounds (--rounds), the round whose TPOT is the median (a real run, so that its TPOT, hit
    rates and bound stay one run's numbers)."""
    by_share: dict = {}
    for r in w["runs"]:
        if r.get("predictor", "none") == "none" and "tpot_ms" in r:
            by_share.setdefault(r["share"], []).append(r)
    return [sorted(rs, key=lambda r: r["tpot_ms"])[(len(rs) - 1) // 2] for _, rs in sorted(by_share.items())]


def predictor_runs(w: dict) -> dict:
    """{predictor: {share: stall ms per token, the median over rounds}} of the finished runs, when
    more than one predictor ran."""
    summary = w["round_summary"]
    if len({m["predictor"] for m in summary}) < 2:
        return {}
    table: dict = {}
    for m in summary:
        table.setdefault(m["predictor"], {})[m["share"]] = m["stall_ms_per_token"]
    return table


def workload_figure(w: dict):
    """A matplotlib Figure for one workload of bench.json (see the module's paragraph)."""
    from matplotlib.figure import Figure

    runs = completed_baseline(w)
    stalls = predictor_runs(w)
    n_panels = 3 if stalls else 2
    fig = Figure(figsize=(PANEL_INCHES[0] * n_panels, PANEL_INCHES[1]), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, n_panels)
    m = w["model"]
    fig.suptitle(f"{w['name']}: {m.get('preset', '?')} {m.get('quant', '?')}, {m['n_layer']} layers x "
                 f"{m['n_expert']} experts, top-{m['n_expert_used']}")
    shares = [100 * r["share"] for r in runs]

    ax = axes[0]
    ax.plot(shares, [r["tpot_ms"] for r in runs], "o-", label="streamed TPOT")
    bound = [(r["share"], r["lower_bound_ms_per_token"]) for r in runs if r["lower_bound_ms_per_token"] is not None]
    resident = w["resident"]["tpot_ms"]
    if bound:
        ax.plot([100 * s for s, _ in bound], [lb + resident for _, lb in bound], "s--", label="IO lower bound + resident")
    ax.axhline(resident, color="grey", linestyle=":", label="resident TPOT")
    ax.set(xlabel="experts in RAM (% of all)", ylabel="ms per token", title="time per output token")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")

    ax = axes[1]
    for key, label, style in (("hit_rate", "engine", "o-"), ("belady_hit_rate", "Belady (optimal)", "s--"),
                              ("lru_hit_rate", "LRU", "^:")):
        ax.plot(shares, [r[key] for r in runs], style, label=label)
    ax.set(xlabel="experts in RAM (% of all)", ylabel="hit rate", title="expert cache hit rate", ylim=(0, 1.02))
    ax.legend(fontsize="small")

    if stalls:
        ax = axes[2]
        all_shares = sorted({s for per_share in stalls.values() for s in per_share})
        width = 0.8 / len(stalls)
        for i, (pred, per_share) in enumerate(stalls.items()):
            xs = [j + (i - (len(stalls) - 1) / 2) * width for j, s in enumerate(all_shares) if s in per_share]
            ax.bar(xs, [per_share[s] for s in all_shares if s in per_share], width, label=pred)
        ax.set_xticks(range(len(all_shares)), [f"{100 * s:g}%" for s in all_shares])
        ax.set(xlabel="experts in RAM", ylabel="stall ms per token", title=f"predictors (lookahead "
               f"{w['predictors']['lookahead']})")
        ax.legend(fontsize="small")
    return fig


def write_plots(doc: dict, out: Path) -> tuple[list, str | None]:
    """Writes out/bench-WORKLOAD.png for every workload with a finished baseline run. Returns (the
    paths written, None), or ([], why none were) when matplotlib is missing or nothing ran."""
    try:
        import matplotlib  # noqa: F401  (the optional extra; the figure imports its parts)
    except ImportError:
        return [], MISSING_MATPLOTLIB
    written = []
    for w in doc["workloads"]:
        if "skipped" in w or not completed_baseline(w):
            continue
        path = Path(out) / f"bench-{w['name']}.png"
        workload_figure(w).savefig(path, dpi=DPI)
        written.append(path)
    return written, None if written else "no plots: no workload has a finished run"
