"""Issue 16: offline search for per-expert features of the depthtime stacker. Fits one weight vector
per (d, t) over a chosen set of feature columns on a trained depthtime sidecar's validation rows and
scores held-out sequences exactly as `sharpi predictor eval` scores (recall@k with exactly k
predictions, d = 1..3, every target layer t in [d, n_layer), rows with no known selected id skipped,
ties to the lower id).

    PYTHONPATH=python nice -n 19 python tools/stacker_feature_search.py \
        --trace ../shared/traces/llama4_maverick_train.npz --train-seqs 0:189 --test-seqs 189:270 \
        --depthtime dtp_l4.gguf --variants A,B,C,product,sidecar
    PYTHONPATH=python nice -n 19 python tools/stacker_feature_search.py \
        --trace ../shared/traces/deepseek_v2_lite_train.npz --train-seqs 0:200 --test-seqs 979:1099 \
        --depthtime dtp_ds200.gguf --variants C,C+ind,C+win,product+ALL --cache /tmp/exp16-cache

The sidecar must be in the 33-feature format (dt.stack; sharpi.predict.sidecar.DEPTHTIME_FEATURES)
and trained on --train-seqs. The product's features come from the product's own definition,
reference.DepthTimePredictor.features, selected by column name (reg, cnt, prev1..4, hist<λ>, freq,
vote<p>, nvote<p> and the products "a*b"), so this tool cannot drift from the product. Variants:
  A, B, C     subsets of the 17 base features (A: reg, cnt, prev1, hist0.9; B: + prev2..4, the other
              decays, freq; C: + the six votes); "product" all 33, fitted here; "sidecar" all 33 with
              the sidecar's own dt.stack weights, no fit (its numbers equal `predictor eval`'s); the
              earlier tool's "C+prods" is "product" (the same 33 columns)
  C+... / D / ALL / product+ALL   C or the product plus candidate features the product lacks (below)
  NAME:mlpH   NAME fitted by a linear score plus one hidden ReLU layer of H units (exploration only)
Linear fits are the product's (regression.fit_stack_weights: L-BFGS on standardised features, and a
single feature with unit weight kept where it recalls better on the fit rows). The fit rows are the
depthtime validation rows of --train-seqs (the last 15% of those sequences, at most 4000 tokens drawn
with seed 0, as `predictor train` draws them), or --stack-seqs; held-out sequences are used only for
the printed recall. Every token's features see its whole sequence prefix, as `predictor eval` does.

Candidate features, computed here from the current sequence's selected sets (every earlier token's
sets at every layer, the current token's sets at layers <= L) and the sidecar's tables. Notation:
S_j(l) the set token j selected at layer l (|S| = k), hit_j(l, e) = [e in S_j(l)],
c_l(i, j) = |S_i(l) ∩ S_j(l)| / k, m_L(i, j) = mean of c_l(i, j) over l <= L; source layer L = t - d;
j ranges over the earlier tokens of the same sequence (j < i); every "n" feature is the raw vote
divided by the sum of its weights (max(sum, 1e-6)):
  wvote<w>_<p>   sum_j a_w(i, j)^p hit_j(t, e), a_w(i, j) = mean of c_l(i, j) over l in
                 [max(0, L-w+1), L] (similarity of the last w source layers only); nwvote normalised
  xvote          sum_j x_L(i, j) hit_j(t, e), x_L(i, j) = 1 when S_i(l) = S_j(l) for every l <= L
  rvote<p>       sum_j m_L(i, j)^p 0.9^(i-j-1) hit_j(t, e) (the product's route similarity times recency)
  ind<p>         sum_{1 <= j < i} M(i-1, j-1)^p hit_j(t, e), M = mean of c_l over ALL layers: earlier
                 tokens j whose predecessor routed like the current token's predecessor vote for
                 their own choice at t (the route of i-1 is complete when i is decoded)
  cind<p>        the same weights times m_L(i, j)^p (predecessor and current route both alike)
  cnt2, cnt3     depthtime's count scores of source layers L-1 and L-2 for target t (the tables of
                 d+1, d+2; 0 where d+1 > 3 or the layer does not exist)
  regp           softmax of reg over the experts; regrank 1 / (1 + rank of reg), rank 0 the highest
  logfreq        log(freq + 1/64)
The product's votes count only the latest DEPTHTIME_VOTE_WINDOW = 1,024 earlier tokens; these
candidate votes have no window. That matters only for longer sequences: none in the Llama-4 trace
(longest 187 tokens), 23 of 1,399 in the DeepSeek one (longest 2,850).
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time

import numpy as np
from sharpi.predict.evaluate import _set_metrics
from sharpi.predict.reference import DepthTimePredictor, predicted_sets
from sharpi.predict.regression import fit_stack_weights
from sharpi.predict.sidecar import (
    DEPTHTIME_BASE_FEATURES,
    DEPTHTIME_FEATURES,
    DEPTHTIME_VOTE_POWERS,
    read_sidecar,
)
from sharpi.predict.traces import load_trace, sequences_slice
from sharpi.predict.train import validation_rows

WINDOWS = (1, 3)
POWERS = (1, 4, 16)
IND_POWERS = (4, 16)
RECENCY = 0.9
WIN = [f"{n}wvote{w}_{p}" for w in WINDOWS for p in POWERS for n in ("", "n")]
EXACT = ["xvote", "nxvote"]
REC = [f"{n}rvote{p}" for p in IND_POWERS for n in ("", "n")]
IND = [f"{n}ind{p}" for p in IND_POWERS for n in ("", "n")] + [
    f"{n}cind{p}" for p in IND_POWERS for n in ("", "n")
]
VOTE_CANDIDATES = WIN + EXACT + REC + IND  # computed together, per sequence, by candidate_votes
CNTX = ["cnt2", "cnt3"]
PRODUCT = list(DEPTHTIME_FEATURES)
A = ["reg", "cnt", "prev1", "hist0.9"]
B = PRODUCT[: PRODUCT.index("freq") + 1]
C = list(DEPTHTIME_BASE_FEATURES)
VOTES = C[-2 * len(DEPTHTIME_VOTE_POWERS) :]
NONLIN = ["regp", "regrank", "logfreq", "reg*nvote4", "regp*nvote4", "reg*prev1"]
CANDIDATES = VOTE_CANDIDATES + CNTX + ["regp", "regrank", "logfreq"]
VARIANTS = {
    "A": A,
    "B": B,
    "C": C,
    "product": PRODUCT,
    "sidecar": PRODUCT,  # the sidecar's dt.stack weights, not fitted here
    "C+win": C + WIN,
    "C+exact": C + EXACT,
    "C+rec": C + REC,
    "C+ind": C + IND,
    "C+cntx": C + CNTX,
    "C+nonlin": C + NONLIN,
    "ALL": C + WIN + EXACT + REC + IND + CNTX + NONLIN,
    "D": C + NONLIN + IND + WIN,
    "C+regp": C + ["regp"],
    "C+regrank": C + ["regrank"],
    "C+logfreq": C + ["logfreq"],
    "C+products": C + ["reg*nvote4", "regp*nvote4", "reg*prev1"],
    "C+regp+rank+ind": C + ["regp", "regrank"] + IND,
    "D+prods": C + NONLIN + IND + WIN + [f"{a}*{v}" for a in ("reg", "regp") for v in VOTES if v != "nvote4"],
    "product+ALL": PRODUCT + CANDIDATES,
}
COLUMN = {name: i for i, name in enumerate(DEPTHTIME_FEATURES)}


def seq_range(text: str) -> tuple[int, int]:
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


def _put(out: dict, name: str, d: int, shape, rows, t, value) -> None:
    if (name, d) not in out:
        out[name, d] = np.zeros(shape, np.float32)
    out[name, d][rows, t] = value


def _vote(out: dict, need: set, shape, hot: np.ndarray, rows, at, name: str, w: np.ndarray, ds) -> None:
    """out[name, d][rows, t] = (w @ hot[:, t])[at] and its normalised twin, for (d, t) in ds; nothing
    unless `need` names one of the two."""
    if name not in need and "n" + name not in need:
        return
    w_sum = np.maximum(w.sum(axis=1, keepdims=True), 1e-6)
    for d, t in ds:
        v = w @ hot[:, t]
        _put(out, name, d, shape, rows, t, v[at])
        _put(out, "n" + name, d, shape, rows, t, (v / w_sum)[at])


def candidate_votes(trace, idx: np.ndarray, need: set) -> dict:
    """{(name, d): float32 [N, n_layer(t), E]} of the VOTE_CANDIDATES named in `need` (and their raw /
    normalised twins; d = 0: independent of d)."""
    n_layer, E, k = trace.n_layer, trace.n_expert, trace.top_k
    shape = (len(idx), n_layer, E)
    out: dict = {}
    if not need & set(VOTE_CANDIDATES):
        return out
    for rows, hot, at in sequence_hots(trace, idx):
        T = len(hot)
        match = np.einsum("ile,jle->lij", hot, hot) / k  # [n_layer, T, T]
        csum = np.cumsum(match, axis=0)
        route = csum / np.arange(1, n_layer + 1)[:, None, None]
        exact = np.cumprod(match > 1 - 1e-6, axis=0).astype(np.float32)
        earlier = np.tril(np.ones((T, T), np.float32), -1)
        gap = np.arange(T)[:, None] - np.arange(T)[None, :] - 1
        recency = np.where(earlier > 0, RECENCY ** np.maximum(gap, 0), 0).astype(np.float32)
        pred = np.zeros((T, T), np.float32)  # pred[i, j] = M(i-1, j-1) for 1 <= j < i
        pred[1:, 1:] = route[-1][:-1, :-1] * earlier[1:, 1:]

        for p in IND_POWERS:
            _vote(out, need, shape, hot, rows, at, f"ind{p}", pred**p, [(0, t) for t in range(n_layer)])
        for L in range(n_layer - 1):
            ds = [(d, L + d) for d in (1, 2, 3) if L + d < n_layer]
            for wl in WINDOWS:
                lo = L - wl
                a = (csum[L] - (csum[lo] if lo >= 0 else 0)) / (L - max(lo, -1))
                for p in POWERS:
                    _vote(out, need, shape, hot, rows, at, f"wvote{wl}_{p}", a**p * earlier, ds)
            _vote(out, need, shape, hot, rows, at, "xvote", exact[L] * earlier, ds)
            for p in IND_POWERS:
                m = route[L] ** p
                _vote(out, need, shape, hot, rows, at, f"rvote{p}", m * recency, ds)
                _vote(out, need, shape, hot, rows, at, f"cind{p}", pred**p * m, ds)
    return out


def cached_votes(trace, idx: np.ndarray, need: set, cache: str | None, tag: str, write: bool) -> dict:
    """candidate_votes, kept in `cache` as TAG[-names].pkl; the file of every candidate (no suffix)
    serves any need."""
    wanted = sorted(need & set(VOTE_CANDIDATES))
    if not wanted:
        return {}
    full = os.path.join(cache, f"{tag}.pkl") if cache else None
    if wanted != sorted(VOTE_CANDIDATES):
        tag += "-" + "-".join(wanted)
    path = os.path.join(cache, f"{tag}.pkl") if cache else None
    for p in (path, full):
        if p and os.path.exists(p):
            with open(p, "rb") as f:
                return pickle.load(f)
    votes = candidate_votes(trace, idx, need)
    if path and write:
        os.makedirs(cache, exist_ok=True)
        with open(path, "wb") as f:
            pickle.dump(votes, f, protocol=4)
    return votes


def column(name: str, X: np.ndarray, votes: dict, ref: DepthTimePredictor, trace, idx, d: int, t: int):
    """Feature `name` of target t at distance d, [N, E]: a product column of X = the product's
    features [N, E, 33] of (d, t), or a candidate."""
    if name in COLUMN:
        return X[:, :, COLUMN[name]]
    if (name, d) in votes:
        return votes[name, d][:, t]
    if (name, 0) in votes:
        return votes[name, 0][:, t]
    if name in ("cnt2", "cnt3"):
        dd = d + (1 if name == "cnt2" else 2)
        if dd > ref.max_lookahead or t - dd < 0:
            return np.zeros(X.shape[:2])
        return ref.t["dt.count_bias"][t] + trace.multi_hot(idx, t - dd) @ ref.t["dt.count"][t, dd - 1]
    reg = X[:, :, COLUMN["reg"]]
    if name == "regp":
        regp = np.exp(reg - reg.max(axis=1, keepdims=True))
        return regp / regp.sum(axis=1, keepdims=True)
    if name == "regrank":
        rank = np.argsort(np.argsort(-reg, axis=1, kind="stable"), axis=1)
        return 1.0 / (1.0 + rank)
    if name == "logfreq":
        return np.log(X[:, :, COLUMN["freq"]] + 1.0 / 64)
    raise KeyError(name)


def stack(names, X, votes, ref, trace, idx, d: int, t: int) -> np.ndarray:
    return np.stack([column(n, X, votes, ref, trace, idx, d, t) for n in names], axis=-1)  # [N, E, F]


def fit_mlp(
    torch, X: np.ndarray, sel: np.ndarray, hidden: int, l2: float = 1e-3, max_iter: int = 100
) -> dict:
    """A linear score plus one hidden ReLU layer, both over the standardised features z = (x - mu) / sd:
    score_e = z_e @ w + relu(z_e @ W1 + b1) @ w2, fitted like the linear stacker (softmax cross-entropy
    against sel / |sel|, l2 on every weight, L-BFGS), starting from w = 0 and a small seeded W1.
    Exploration only: the product's stacker is linear."""
    Xt, Y = torch.from_numpy(X.astype(np.float32)), torch.from_numpy(sel.astype(np.float32))
    ok = Y.sum(1) > 0
    Xt, Y = Xt[ok], Y[ok] / Y[ok].sum(1, keepdim=True)
    flat = Xt.reshape(-1, Xt.shape[-1])
    mu, sd = flat.mean(0), flat.std(0) + 1e-6
    Z = (Xt - mu) / sd
    g = torch.Generator().manual_seed(0)
    F = X.shape[-1]
    w = torch.zeros(F, requires_grad=True)
    W1 = (torch.randn(F, hidden, generator=g) / F**0.5).requires_grad_()
    b1 = torch.zeros(hidden, requires_grad=True)
    w2 = (torch.randn(hidden, generator=g) * 0.01).requires_grad_()
    params = [w, W1, b1, w2]
    opt = torch.optim.LBFGS(params, max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        score = Z @ w + torch.relu(Z @ W1 + b1) @ w2
        loss = -(Y * torch.log_softmax(score, 1)).sum(1).mean() + l2 * sum((q * q).sum() for q in params)
        loss.backward()
        return loss

    opt.step(closure)
    return {
        "mu": mu.numpy(),
        "sd": sd.numpy(),
        **{n: q.detach().numpy() for n, q in zip(("w", "W1", "b1", "w2"), params)},
    }


def score(weights, X: np.ndarray) -> np.ndarray:
    if not isinstance(weights, dict):
        return X @ weights
    Z = (X - weights["mu"]) / weights["sd"]
    return Z @ weights["w"] + np.maximum(Z @ weights["W1"] + weights["b1"], 0) @ weights["w2"]


def print_recalls(recalls: dict, prefix: str = "") -> None:
    for name, per_d in recalls.items():
        cells = " ".join(f"{np.concatenate(per_d[d]).mean():.4f}" for d in (1, 2, 3))
        print(f"{prefix}{name:16s} recall@k d=1,2,3: {cells}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument(
        "--train-seqs", type=seq_range, required=True, help="A:B, the depthtime's train sequences"
    )
    ap.add_argument(
        "--stack-seqs",
        type=seq_range,
        help="A:B: fit the stacker on all these sequences' tokens "
        "(default: depthtime's validation rows of --train-seqs)",
    )
    ap.add_argument(
        "--stack-tokens", type=int, default=8000, help="at most this many --stack-seqs tokens (seed 0)"
    )
    ap.add_argument("--test-seqs", type=seq_range, required=True, help="C:D, the held-out sequences")
    ap.add_argument("--depthtime", required=True, help="33-feature depthtime sidecar trained on --train-seqs")
    ap.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated NAME or NAME:mlpH of VARIANTS"
    )
    ap.add_argument("--mlp-iter", type=int, default=100, help="L-BFGS iterations of the :mlpH fits")
    ap.add_argument("--also-report", type=int, help="S: also print the recall over the test sequences < S")
    ap.add_argument("--chunk", type=int, default=20, help="held-out sequences scored at a time")
    ap.add_argument("--cache", help="folder to keep each chunk's candidate votes in (reused when present)")
    ap.add_argument("--cache-readonly", action="store_true", help="reuse --cache files, write none")
    args = ap.parse_args(argv)
    variants = {v: VARIANTS[v.split(":")[0]] for v in args.variants.split(",")}
    if any(v.startswith("sidecar:") for v in variants):
        ap.error("variant sidecar takes the sidecar's weights; it has no :mlpH form")
    import torch

    torch.set_num_threads(1)
    need = {n for cols in variants.values() for n in cols}
    trace = load_trace(args.trace)
    n_layer, E, k = trace.n_layer, trace.n_expert, trace.top_k
    ref = DepthTimePredictor(read_sidecar(args.depthtime, "depthtime", n_layer, E, k))
    if args.stack_seqs:
        fit_idx, tag = sequences_slice(trace, *args.stack_seqs), "stack{}-{}".format(*args.stack_seqs)
        if len(fit_idx) > args.stack_tokens:
            fit_idx = np.sort(np.random.default_rng(0).choice(fit_idx, args.stack_tokens, replace=False))
            tag += f"-{args.stack_tokens}"
    else:
        _, fit_idx = validation_rows(
            trace, sequences_slice(trace, *args.train_seqs), 0.15, 4000, np.random.default_rng(0)
        )
        tag = "val{}-{}".format(*args.train_seqs)
    t0 = time.perf_counter()
    votes = cached_votes(trace, fit_idx, need, args.cache, tag, not args.cache_readonly)
    print(f"candidate votes of {len(fit_idx)} fit tokens: {time.perf_counter() - t0:.0f} s", flush=True)
    weights, seconds = {}, dict.fromkeys(variants, 0.0)
    for L in range(n_layer - 1):  # ascending L: the reference adds one layer of route counts per step
        for t, X in ref.features(trace, fit_idx, L).items():
            d = t - L
            sel = trace.multi_hot(fit_idx, t)
            for name, cols in variants.items():
                t1 = time.perf_counter()
                if name == "sidecar":
                    weights[name, d, t] = ref.t["dt.stack"][d - 1, t]
                    continue
                Xv = stack(cols, X, votes, ref, trace, fit_idx, d, t)
                if ":mlp" in name:
                    hidden = int(name.split(":mlp")[1])
                    weights[name, d, t] = fit_mlp(torch, Xv, sel, hidden, max_iter=args.mlp_iter)
                else:
                    weights[name, d, t] = fit_stack_weights(torch, Xv, sel, k)[0]
                seconds[name] += time.perf_counter() - t1
    print(f"features and fits: {time.perf_counter() - t0:.0f} s", flush=True)
    for name, cols in variants.items():
        print(f"fits of {name} ({len(cols)} features): {seconds[name]:.0f} s", flush=True)
    del votes
    recalls = {name: {d: [] for d in (1, 2, 3)} for name in variants}
    first, end = args.test_seqs
    for s0 in range(first, end, args.chunk):
        s1 = min(s0 + args.chunk, end)
        rows = sequences_slice(trace, s0, s1)
        votes = cached_votes(trace, rows, need, args.cache, f"test{s0}-{s1}", not args.cache_readonly)
        for L in range(n_layer - 1):
            for t, X in ref.features(trace, rows, L).items():
                d, sel = t - L, trace.selected(rows, t)
                for name, cols in variants.items():
                    s = score(weights[name, d, t], stack(cols, X, votes, ref, trace, rows, d, t))
                    # Exactly as `predictor eval` scores: its predicted sets and per-row metrics.
                    recalls[name][d].append(_set_metrics(predicted_sets(s, k), sel, E)["recall_at_k"])
        del votes
        if s1 == args.also_report:
            print_recalls(recalls, f"[{first}, {s1}) ")
        print(f"scored [{first}, {s1}): {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"held-out sequences [{first}, {end}) scored: {time.perf_counter() - t0:.0f} s in all")
    print_recalls(recalls)
    if args.cache and not args.cache_readonly:
        with open(os.path.join(args.cache, f"weights-{tag}.pkl"), "wb") as f:
            pickle.dump(weights, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
