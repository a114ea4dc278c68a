"""Issue 16: the three baselines of `sharpi predictor eval` (prev_token, cooc_counts,
softmax_regression) trained on a sequence range of a trace and scored on other sequence ranges of the
same trace, with the functions `predictor eval --heldout` calls (recall@k with exactly k predictions).

    PYTHONPATH=python nice -n 19 python tools/heldout_baselines.py \
        --trace ../shared/traces/deepseek_v2_lite_train.npz --train-seqs 0:400 --test-seqs 979:1099,979:1399
"""

from __future__ import annotations

import argparse
import sys
import time

from sharpi.predict.evaluate import evaluate
from sharpi.predict.reference import CoocPredictor, PrevTokenPredictor
from sharpi.predict.regression import count_cooc_baseline, train_regression_baseline
from sharpi.predict.traces import load_trace, sequences_slice
from stacker_feature_search import seq_range


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--train-seqs", type=seq_range, required=True, help="A:B, the sequences trained on")
    ap.add_argument("--test-seqs", required=True, help="C:D[,E:F...], held-out sequence ranges to score")
    ap.add_argument("--epochs", type=int, default=2, help="softmax regression epochs")
    args = ap.parse_args(argv)
    trace = load_trace(args.trace)
    train_idx = sequences_slice(trace, *args.train_seqs)
    t0 = time.perf_counter()
    predictors = [
        ("prev_token", PrevTokenPredictor(trace.n_expert)),
        ("cooc_counts", CoocPredictor(count_cooc_baseline(trace, train_idx))),
        (
            "softmax_regression",
            CoocPredictor(train_regression_baseline(trace, train_idx, epochs=args.epochs)),
        ),
    ]
    print(
        f"baselines trained on sequences {args.train_seqs} ({len(train_idx)} tokens): "
        f"{time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    for text in args.test_seqs.split(","):
        idx = sequences_slice(trace, *seq_range(text))
        for name, predictor in predictors:
            rows = evaluate(predictor, trace, idx)["rows"]
            cells = " ".join(f"{r['recall_at_k']:.4f}" for r in rows)
            print(f"[{text}) {name:20s} recall@k d=1,2,3: {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
