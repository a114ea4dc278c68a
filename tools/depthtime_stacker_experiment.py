"""Issue 16 phase-1 experiment: a per-expert linear stacker over depth and time features, on top of a
trained depthtime sidecar, scored on held-out sequences exactly as `sharpi predictor eval` scores
(recall@k with exactly k predictions, d = 1..3, every target layer t in [d, n_layer), rows with no
known selected id skipped, ties to the lower id).

Usage (from the repository root, after `sharpi predictor train --kind depthtime` on the same
train sequences, or any depthtime sidecar trained on them):

    PYTHONPATH=python nice -n 19 python tools/depthtime_stacker_experiment.py \
        --trace ../shared/traces/llama4_maverick_train.npz --train-seqs 0:189 --test-seqs 189:270 \
        --depthtime dt_l4.gguf

For token i, target layer t and distance d (source layer L = t - d), every expert e gets the
features (docs/predictors.md, "Held-out evaluation (issue 16)"):
  reg        the depthtime regression score (dt.bias + dt.layer rows of layers 0..L + dt.prev rows)
  cnt        the depthtime co-occurrence count score of layer L (dt.count_bias + dt.count)
  prev1..4   [e in S_{-j}(t)]: the j-th previous token of the sequence chose e at layer t
  hist<λ>    sum_{j >= 1} λ^(j-1) [e in S_{-j}(t)] for λ in DECAYS
  freq       the fraction of the earlier tokens of the sequence that chose e at layer t
  vote<p>    sum_{j < i} m_L(i, j)^p [e in S_j(t)], m_L(i, j) = mean over layers l <= L of
             |S_i(l) ∩ S_j(l)| / k (how closely an earlier token j of the same sequence followed the
             current token's route so far: a retrieval of tokens that route alike)
  nvote<p>   vote<p> divided by sum_{j < i} m_L(i, j)^p (a weighted average; 0 with no earlier token)
and score = features @ w[d, t]. w[d, t] is fitted per (d, t) by softmax cross-entropy against the
selected set (plus a small L2 on standardised features, L-BFGS) on the depthtime validation rows:
the last 15% of the TRAIN sequences, at most 4000 tokens drawn with seed 0 (train.validation_rows,
the same rows `predictor train` uses to choose the depthtime mix). Held-out sequences are used only
for the printed recall. Every token's features see its whole sequence prefix, as `predictor eval`
and trace replay do.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from sharpi.predict.regression import DEPTHTIME_PREV_OFFSETS, _as_params, _ids, _target_scores
from sharpi.predict.sidecar import read_sidecar
from sharpi.predict.traces import load_trace, sequences_slice
from sharpi.predict.train import validation_rows

DECAYS = (0.5, 0.8, 0.9, 0.97)
VOTE_POWERS = (1, 4, 16)
TIME = ["prev1", "prev2", "prev3", "prev4"] + [f"hist{lam}" for lam in DECAYS] + ["freq"]
VOTES = [f"vote{p}" for p in VOTE_POWERS] + [f"nvote{p}" for p in VOTE_POWERS]
VARIANTS = {
    "A: reg, cnt, prev1, hist0.9": ["reg", "cnt", "prev1", "hist0.9"],
    "B: reg, cnt + time": ["reg", "cnt", *TIME],
    "C: reg, cnt + time + votes": ["reg", "cnt", *TIME, *VOTES],
}


def _seq_range(text: str) -> tuple[int, int]:
    a, b = text.split(":")
    return int(a), int(b)


def sequence_hots(trace, idx: np.ndarray):
    """Per sequence that the tokens idx touch: (rows, hot, at): rows the positions in idx of its tokens,
    hot float32 [T, n_layer, E] the multi-hot selections of its first T tokens (through its last token
    in idx), at the in-sequence positions of the tokens rows."""
    seq = np.searchsorted(trace.seq_start, idx, side="right") - 1
    for s in np.unique(seq):
        rows = np.nonzero(seq == s)[0]
        first = int(trace.seq_start[s])
        T = int(idx[rows].max()) - first + 1
        ids = trace.experts[first : first + T].astype(np.int64)
        hot = np.zeros((T, trace.n_layer, trace.n_expert), np.float32)
        ti, li, ki = np.nonzero(ids >= 0)
        hot[ti, li, ids[ti, li, ki]] = 1
        yield rows, hot, idx[rows] - first


def time_features(trace, idx: np.ndarray) -> tuple[dict, dict]:
    """({name in TIME: float32 [N, n_layer, E]}, {(name in VOTES, d): float32 [N, n_layer(t), E]})
    for the tokens idx (each computed over its whole sequence prefix)."""
    n_layer, E, k = trace.n_layer, trace.n_expert, trace.top_k
    N = len(idx)
    feats = {n: np.zeros((N, n_layer, E), np.float32) for n in TIME}
    votes = {(n, d): np.zeros((N, n_layer, E), np.float32) for n in VOTES for d in (1, 2, 3)}
    for rows, hot, at in sequence_hots(trace, idx):
        T = len(hot)
        for j in (1, 2, 3, 4):
            shifted = np.zeros_like(hot)
            shifted[j:] = hot[: T - j] if j < T else 0
            feats[f"prev{j}"][rows] = shifted[at]
        for lam in DECAYS:
            h = np.zeros_like(hot)
            for i in range(1, T):
                h[i] = lam * h[i - 1] + hot[i - 1]
            feats[f"hist{lam}"][rows] = h[at]
        before = np.zeros_like(hot)
        before[1:] = np.cumsum(hot, axis=0)[:-1] / np.arange(1, T)[:, None, None]
        feats["freq"][rows] = before[at]
        match = np.einsum("ile,jle->lij", hot, hot) / k  # [n_layer, T, T]
        route = np.cumsum(match, axis=0) / np.arange(1, n_layer + 1)[:, None, None]
        earlier = np.tril(np.ones((T, T), np.float32), -1)
        for p in VOTE_POWERS:
            for L in range(n_layer - 1):
                w = route[L] ** p * earlier
                w_sum = np.maximum(w.sum(axis=1, keepdims=True), 1e-6)
                for d in (1, 2, 3):
                    if L + d < n_layer:
                        v = w @ hot[:, L + d]
                        votes[f"vote{p}", d][rows, L + d] = v[at]
                        votes[f"nvote{p}", d][rows, L + d] = (v / w_sum)[at]
    return feats, votes


def depth_scores(torch, trace, idx: np.ndarray, dt: dict) -> tuple[dict, dict]:
    """({(d, t): reg [N, E]}, {(d, t): cnt [N, E]}) of the depthtime tables dt."""
    p = {n: dt[f"dt.{n}"].astype(np.float64) for n in ("bias", "layer", "prev")}
    tables = _as_params(torch, p)
    f = _ids(torch, trace, idx)
    reg, cnt = {}, {}
    with torch.no_grad():
        for t in range(1, trace.n_layer):
            for d, s in enumerate(_target_scores(torch, tables, f, t, DEPTHTIME_PREV_OFFSETS, 3), 1):
                reg[d, t] = s.numpy()
                src = trace.multi_hot(idx, t - d, np.float32)
                cnt[d, t] = (dt["dt.count_bias"][t] + src @ dt["dt.count"][t, d - 1]).astype(np.float32)
    return reg, cnt


def stack(names, feats, votes, reg, cnt, d: int, t: int) -> np.ndarray:
    cols = []
    for n in names:
        if n == "reg":
            cols.append(reg[d, t])
        elif n == "cnt":
            cols.append(cnt[d, t])
        elif n in VOTES:
            cols.append(votes[n, d][:, t])
        else:
            cols.append(feats[n][:, t])
    return np.stack(cols, axis=-1)  # [N, E, F]


def fit_weights(torch, X: np.ndarray, sel: np.ndarray, l2: float = 1e-3, max_iter: int = 40) -> np.ndarray:
    """w [F] minimising softmax cross-entropy of X @ w against sel / |sel| (+ l2 on standardised w)."""
    X, Y = torch.from_numpy(X), torch.from_numpy(sel)
    ok = Y.sum(1) > 0
    X, Y = X[ok], Y[ok] / Y[ok].sum(1, keepdim=True)
    scale = X.reshape(-1, X.shape[-1]).std(0) + 1e-6
    w = torch.zeros(X.shape[-1], requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = -(Y * torch.log_softmax((X / scale) @ w, 1)).sum(1).mean() + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return (w.detach() / scale).numpy()


def recall_rows(scores: np.ndarray, sel: np.ndarray, k: int) -> np.ndarray:
    """Per-row |top-k ∩ S| / |S| (stable order: ties to the lower id), rows with |S| > 0."""
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    hit = np.take_along_axis(sel, top, axis=1).sum(1)
    n = sel.sum(1)
    return hit[n > 0] / n[n > 0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--train-seqs", type=_seq_range, required=True, help="A:B, the sequences trained on")
    ap.add_argument("--test-seqs", type=_seq_range, required=True, help="C:D, the held-out sequences")
    ap.add_argument("--depthtime", required=True, help="depthtime sidecar trained on --train-seqs")
    ap.add_argument("--chunk", type=int, default=40, help="held-out sequences scored at a time")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    trace = load_trace(args.trace)
    n_layer, k = trace.n_layer, trace.top_k
    dt = read_sidecar(args.depthtime, "depthtime", n_layer, trace.n_expert, k, 3).tensors
    train_idx = sequences_slice(trace, *args.train_seqs)
    _, val_idx = validation_rows(trace, train_idx, 0.15, 4000, np.random.default_rng(0))
    t0 = time.perf_counter()
    feats, votes = time_features(trace, val_idx)
    reg, cnt = depth_scores(torch, trace, val_idx, dt)
    weights = {}
    for name, cols in VARIANTS.items():
        for d in (1, 2, 3):
            for t in range(d, n_layer):
                X = stack(cols, feats, votes, reg, cnt, d, t)
                weights[name, d, t] = fit_weights(torch, X, trace.multi_hot(val_idx, t, np.float32))
    print(f"features and fits on {len(val_idx)} validation tokens: {time.perf_counter() - t0:.0f} s")
    del feats, votes, reg, cnt
    recalls = {name: {d: [] for d in (1, 2, 3)} for name in VARIANTS}
    first, end = args.test_seqs
    for s0 in range(first, end, args.chunk):
        rows = sequences_slice(trace, s0, min(s0 + args.chunk, end))
        feats, votes = time_features(trace, rows)
        reg, cnt = depth_scores(torch, trace, rows, dt)
        for d in (1, 2, 3):
            for t in range(d, n_layer):
                sel = trace.multi_hot(rows, t, np.float32)
                for name, cols in VARIANTS.items():
                    s = stack(cols, feats, votes, reg, cnt, d, t) @ weights[name, d, t]
                    recalls[name][d].append(recall_rows(s, sel, k))
    print(f"held-out sequences [{first}, {end}) scored: {time.perf_counter() - t0:.0f} s in all")
    for name in VARIANTS:
        cells = " ".join(f"{np.concatenate(recalls[name][d]).mean():.4f}" for d in (1, 2, 3))
        print(f"{name:32s} recall@k d=1,2,3: {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
