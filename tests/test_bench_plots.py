"""`sharpi bench`'s PNG plots (sharpi.bench.plots, issue 20), rendered from a small bench result
written out here by hand.

Oracles: the PNG header read with struct (its signature and IHDR size, per the PNG specification),
the pixels decoded by Pillow (not matplotlib's writer), and the numbers of the hand-written result:
every drawn line and bar must carry exactly those values (the lower bound line their sum with the
resident TPOT, the bars stall_ms / tokens worked out here).
"""

from __future__ import annotations

import struct
import sys

import numpy as np

# matplotlib (and Pillow, which it requires) come with the test extra: a missing one fails, never skips.
from PIL import Image
from sharpi.bench.plots import DPI, MISSING_MATPLOTLIB, PANEL_INCHES, workload_figure, write_plots
from sharpi.bench.report import round_summary

RESIDENT_TPOT = 40.0


def run(share, predictor="none", tpot=100.0, lb=30.0, hit=0.5, belady=0.7, lru=0.45, stall_ms=640.0, tokens=32):
    return {"share": share, "predictor": predictor, "tpot_ms": tpot, "lower_bound_ms_per_token": lb,
            "hit_rate": hit, "belady_hit_rate": belady, "lru_hit_rate": lru, "stall_ms": stall_ms, "tokens": tokens}


def small_result() -> dict:
    model = {"preset": "tiny", "quant": "q4_k_m", "n_layer": 4, "n_expert": 16, "n_expert_used": 2}
    random_runs = [
        run(0.25, tpot=180.0, lb=90.0, hit=0.40, belady=0.62, lru=0.35, stall_ms=3200.0),
        run(0.25, "cooc", tpot=150.0, stall_ms=2400.0),
        run(0.5, tpot=120.0, lb=None, hit=0.71, belady=0.83, lru=0.69, stall_ms=1600.0),
        run(0.5, "cooc", tpot=110.0, stall_ms=800.0),
        {"share": 1.0, "predictor": "none", "error": "killed"},  # a failed run is not drawn
    ]
    return {"workloads": [
        {"name": "random", "model": model, "resident": {"tpot_ms": RESIDENT_TPOT}, "runs": random_runs,
         "round_summary": round_summary(random_runs), "predictors": {"lookahead": 1}},
        {"name": "trace", "skipped": "no trace"},
        {"name": "broken", "model": model, "resident": {"tpot_ms": 1.0},
         "runs": [{"share": 0.25, "predictor": "none", "error": "killed"}], "round_summary": [],
         "predictors": {"lookahead": 1}},
    ]}


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    return struct.unpack(">II", data[16:24])


def test_plots_are_pngs_of_the_results_numbers(tmp_path):
    doc = small_result()
    paths, note = write_plots(doc, tmp_path)
    assert note is None
    assert [p.name for p in paths] == ["bench-random.png"], "skipped and failed-only workloads get no plot"
    data = paths[0].read_bytes()
    # Three panels (TPOT, hit rates, predictors), each PANEL_INCHES at DPI.
    assert png_size(data) == (round(3 * PANEL_INCHES[0] * DPI), round(PANEL_INCHES[1] * DPI))
    pixels = np.asarray(Image.open(paths[0]).convert("RGB")).reshape(-1, 3)
    not_white = float(np.mean((pixels != 255).any(axis=1)))
    assert 0.02 < not_white < 0.6, f"{not_white:.1%} of the pixels are drawn: blank or filled"
    # matplotlib's first colour (C0, #1f77b4) draws the TPOT line, the engine's hit rate and the
    # first predictor's bars: it must be on the image, not only in the figure.
    assert int(np.sum((pixels == (0x1F, 0x77, 0xB4)).all(axis=1))) > 200

    fig = workload_figure(doc["workloads"][0])
    tpot_ax, hit_ax, stall_ax = fig.axes
    tpot, bound, resident = tpot_ax.lines
    assert list(tpot.get_xdata()) == [25.0, 50.0] and list(tpot.get_ydata()) == [180.0, 120.0]
    # The 50% run has no bound (Belady needed no reads): the bound line has the 25% point only.
    assert list(bound.get_xdata()) == [25.0] and list(bound.get_ydata()) == [90.0 + RESIDENT_TPOT]
    assert list(resident.get_ydata()) == [RESIDENT_TPOT, RESIDENT_TPOT]
    assert [list(line.get_ydata()) for line in hit_ax.lines] == [[0.40, 0.71], [0.62, 0.83], [0.35, 0.69]]
    heights = sorted(round(bar.get_height(), 9) for bar in stall_ax.patches)
    assert heights == sorted([3200 / 32, 2400 / 32, 1600 / 32, 800 / 32])


def test_no_predictor_axis_gives_two_panels(tmp_path):
    doc = small_result()
    w = doc["workloads"][0]
    w["runs"] = [r for r in w["runs"] if r["predictor"] == "none"]
    w["round_summary"] = round_summary(w["runs"])
    (path,), _ = write_plots(doc, tmp_path)
    assert png_size(path.read_bytes()) == (round(2 * PANEL_INCHES[0] * DPI), round(PANEL_INCHES[1] * DPI))


def test_without_matplotlib_the_bench_says_how_to_get_plots(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    paths, note = write_plots(small_result(), tmp_path)
    assert paths == [] and note == MISSING_MATPLOTLIB and "sharpi[plots]" in note
    assert list(tmp_path.iterdir()) == []


def test_several_rounds_draw_one_point_per_share_at_the_median():
    from sharpi.bench.plots import completed_baseline, predictor_runs

    runs = []
    for rnd, (tpot, stall) in enumerate([(100.0, 320.0), (300.0, 960.0), (120.0, 480.0)]):
        runs.append(dict(run(0.25, tpot=tpot, stall_ms=stall), round=rnd))
        runs.append(dict(run(0.25, "cooc", tpot=tpot - 10, stall_ms=stall / 2), round=rnd))
    w = {"runs": runs, "round_summary": round_summary(runs)}
    (base,) = completed_baseline(w)
    assert base["round"] == 2 and base["tpot_ms"] == 120.0, "the round whose TPOT is the median"
    assert predictor_runs(w) == {"none": {0.25: 15.0}, "cooc": {0.25: 7.5}}  # medians of 10/30/15, 5/15/7.5
