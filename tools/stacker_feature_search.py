"""Issue 16: more per-expert stacker features on top of variant C of depthtime_stacker_experiment.py,
all computable by the engine from the current sequence's selected sets (every earlier token's sets
at every layer, the current token's sets at layers <= L) and trained tables only. Scored exactly
as that tool scores (recall@k with exactly k predictions, held-out sequences, d = 1..3).

    PYTHONPATH=python nice -n 19 python tools/stacker_feature_search.py \
        --trace ../shared/traces/deepseek_v2_lite_train.npz --train-seqs 0:200 --test-seqs 979:1099 \
        --depthtime dt_ds200.gguf --cache /tmp/exp16-cache

Notation: S_j(l) the set token j selected at layer l (|S| = k), hit_j(l, e) = [e in S_j(l)],
c_l(i, j) = |S_i(l) ∩ S_j(l)| / k; source layer L = t - d; j ranges over the earlier tokens of the
same sequence (j < i); every "n" feature is the raw vote divided by the sum of its weights (0 when
that sum is 0, i.e. max(sum, 1e-6)). On top of C's features (see the other tool):
  wvote<w>_<p>   sum_j a_w(i, j)^p hit_j(t, e), a_w(i, j) = mean of c_l(i, j) over l in
                 [max(0, L-w+1), L] (similarity of the last w source layers only); nwvote normalised
  xvote          sum_j x_L(i, j) hit_j(t, e), x_L(i, j) = 1 when S_i(l) = S_j(l) for every l <= L
  rvote<p>       sum_j m_L(i, j)^p 0.9^(i-j-1) hit_j(t, e) (C's route similarity times recency)
  ind<p>         sum_{1 <= j < i} M(i-1, j-1)^p hit_j(t, e), M = mean of c_l over ALL layers: earlier
                 tokens j whose predecessor routed like the current token's predecessor vote for
                 their own choice at t (the route of i-1 is complete when i is decoded)
  cind<p>        the same weights times m_L(i, j)^p (predecessor and current route both alike)
  cnt2, cnt3     depthtime's count scores of source layers L-1 and L-2 for target t (the tables of
                 d+1, d+2; 0 where d+1 > 3 or the layer does not exist)
  regp           softmax of reg over the experts; regrank 1 / (1 + rank of reg), rank 0 the highest
  logfreq        log(freq + 1/64)
  reg_x_nvote4, regp_x_nvote4, prev1_x_reg   products
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time

import numpy as np
from depthtime_stacker_experiment import (
    TIME,
    VOTES,
    _seq_range,
    depth_scores,
    fit_weights,
    recall_rows,
    sequence_hots,
    time_features,
)
from sharpi.predict.sidecar import read_sidecar
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
CNTX = ["cnt2", "cnt3"]
NONLIN = ["regp", "regrank", "logfreq", "reg_x_nvote4", "regp_x_nvote4", "prev1_x_reg"]
C = ["reg", "cnt", *TIME, *VOTES]
VARIANTS = {
    "C": C,
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
    "C+products": C + ["reg_x_nvote4", "regp_x_nvote4", "prev1_x_reg"],
    "C+regp+rank+ind": C + ["regp", "regrank"] + IND,
    "C+prods": C
    + [f"{a}*{v}" for a in ("reg", "regp") for v in VOTES]
    + ["reg*prev1", "reg*hist0.9", "reg*freq", "cnt*nvote4"],
    "D+prods": C + NONLIN + IND + WIN + [f"{a}*{v}" for a in ("reg", "regp") for v in VOTES if v != "nvote4"],
}


def _put(out: dict, name: str, d: int, shape, rows, t, value) -> None:
    if (name, d) not in out:
        out[name, d] = np.zeros(shape, np.float32)
    out[name, d][rows, t] = value


def _vote(out: dict, shape, hot: np.ndarray, rows, at, name: str, w: np.ndarray, ds) -> None:
    """out[name, d][rows, t] = (w @ hot[:, t])[at] and its normalised twin, for (d, t) in ds; nothing
    unless out["need"] names one of the two."""
    if name not in out["need"] and "n" + name not in out["need"]:
        return
    w_sum = np.maximum(w.sum(axis=1, keepdims=True), 1e-6)
    for d, t in ds:
        v = w @ hot[:, t]
        _put(out, name, d, shape, rows, t, v[at])
        _put(out, "n" + name, d, shape, rows, t, (v / w_sum)[at])


def extra_features(trace, idx: np.ndarray, need: set) -> dict:
    """{(name, d): float32 [N, n_layer(t), E]} of the vote features above named in `need` (and their
    raw / normalised twins; d = 0: independent of d)."""
    n_layer, E, k = trace.n_layer, trace.n_expert, trace.top_k
    N = len(idx)
    shape = (N, n_layer, E)
    out: dict = {"need": need}
    if not need & set(WIN + EXACT + REC + IND):
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
            _vote(out, shape, hot, rows, at, f"ind{p}", pred**p, [(0, t) for t in range(n_layer)])
        for L in range(n_layer - 1):
            ds = [(d, L + d) for d in (1, 2, 3) if L + d < n_layer]
            for wl in WINDOWS:
                lo = L - wl
                a = (csum[L] - (csum[lo] if lo >= 0 else 0)) / (L - max(lo, -1))
                for p in POWERS:
                    _vote(out, shape, hot, rows, at, f"wvote{wl}_{p}", a**p * earlier, ds)
            _vote(out, shape, hot, rows, at, "xvote", exact[L] * earlier, ds)
            for p in IND_POWERS:
                m = route[L] ** p
                _vote(out, shape, hot, rows, at, f"rvote{p}", m * recency, ds)
                _vote(out, shape, hot, rows, at, f"cind{p}", pred**p * m, ds)
    return out


def all_features(
    torch, trace, idx: np.ndarray, dt: dict, need: set, cache: str | None, tag: str, write: bool = True
) -> tuple:
    """The features of the tokens idx; the cache file of every extra feature (no suffix) serves any need."""
    extras = sorted(need & set(WIN + EXACT + REC + IND))
    full = os.path.join(cache, f"{tag}.pkl") if cache else None
    if extras != sorted(WIN + EXACT + REC + IND):
        tag += "-" + "-".join(extras)
    path = os.path.join(cache, f"{tag}.pkl") if cache else None
    for p in (path, full):
        if p and os.path.exists(p):
            with open(p, "rb") as f:
                return pickle.load(f)
    feats, votes = time_features(trace, idx)
    reg, cnt = depth_scores(torch, trace, idx, dt)
    extra = extra_features(trace, idx, need)
    result = (feats, votes, reg, cnt, extra)
    if path and write:
        os.makedirs(cache, exist_ok=True)
        with open(path, "wb") as f:
            pickle.dump(result, f, protocol=4)
    return result


def column(name: str, F: tuple, d: int, t: int) -> np.ndarray:
    """Feature `name` of target t at distance d, [N, E]; "a*b" is the product of features a and b."""
    if "*" in name:
        a, b = name.split("*")
        return column(a, F, d, t) * column(b, F, d, t)
    feats, votes, reg, cnt, extra = F
    if name == "reg":
        return reg[d, t]
    if name == "cnt":
        return cnt[d, t]
    if name in ("cnt2", "cnt3"):
        dd = d + (1 if name == "cnt2" else 2)
        return cnt[dd, t] if (dd, t) in cnt else np.zeros_like(reg[d, t])
    if name in VOTES:
        return votes[name, d][:, t]
    if name in feats:
        return feats[name][:, t]
    if (name, d) in extra:
        return extra[name, d][:, t]
    if (name, 0) in extra:
        return extra[name, 0][:, t]
    r = reg[d, t].astype(np.float64)
    regp = np.exp(r - r.max(1, keepdims=True))
    regp = (regp / regp.sum(1, keepdims=True)).astype(np.float32)
    if name == "regp":
        return regp
    if name == "regrank":
        rank = np.argsort(np.argsort(-r, axis=1, kind="stable"), axis=1)
        return (1.0 / (1.0 + rank)).astype(np.float32)
    if name == "logfreq":
        return np.log(feats["freq"][:, t] + 1.0 / 64)
    if name == "reg_x_nvote4":
        return reg[d, t] * votes["nvote4", d][:, t]
    if name == "regp_x_nvote4":
        return regp * votes["nvote4", d][:, t]
    if name == "prev1_x_reg":
        return feats["prev1"][:, t] * reg[d, t]
    raise KeyError(name)


def stack(names, F, d: int, t: int) -> np.ndarray:
    return np.stack([column(n, F, d, t) for n in names], axis=-1)  # [N, E, F]


def fit_mlp(
    torch, X: np.ndarray, sel: np.ndarray, hidden: int, l2: float = 1e-3, max_iter: int = 100
) -> dict:
    """A linear score plus one hidden ReLU layer, both over the standardised features z = (x - mu) / sd:
    score_e = z_e @ w + relu(z_e @ W1 + b1) @ w2, fitted like fit_weights (softmax cross-entropy against
    sel / |sel|, l2 on every weight, L-BFGS), starting from w = 0 and a small seeded W1."""
    Xt, Y = torch.from_numpy(X), torch.from_numpy(sel)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument(
        "--train-seqs", type=_seq_range, required=True, help="A:B, the depthtime's train sequences"
    )
    ap.add_argument(
        "--stack-seqs",
        type=_seq_range,
        help="A:B: fit the stacker on all these sequences' tokens "
        "(default: depthtime's validation rows of --train-seqs)",
    )
    ap.add_argument(
        "--stack-tokens", type=int, default=8000, help="at most this many --stack-seqs tokens (seed 0)"
    )
    ap.add_argument("--test-seqs", type=_seq_range, required=True, help="C:D, the held-out sequences")
    ap.add_argument("--depthtime", required=True, help="depthtime sidecar trained on --train-seqs")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS")
    ap.add_argument("--max-iter", type=int, default=40, help="L-BFGS iterations of the linear fits")
    ap.add_argument("--mlp-iter", type=int, default=100, help="L-BFGS iterations of the :mlpH fits")
    ap.add_argument("--also-report", type=int, help="S: also print the recall over the test sequences < S")
    ap.add_argument("--chunk", type=int, default=20, help="held-out sequences scored at a time")
    ap.add_argument("--cache", help="folder to keep the features of each chunk in (reused when present)")
    ap.add_argument("--cache-readonly", action="store_true", help="reuse --cache files, write none")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    variants = {v: VARIANTS[v.split(":")[0]] for v in args.variants.split(",")}  # NAME or NAME:mlpH
    need = {n for cols in variants.values() for n in cols}
    trace = load_trace(args.trace)
    n_layer, k = trace.n_layer, trace.top_k
    dt = read_sidecar(args.depthtime, "depthtime", n_layer, trace.n_expert, k, 3).tensors
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
    F = all_features(torch, trace, fit_idx, dt, need, args.cache, tag, not args.cache_readonly)
    print(f"features of {len(fit_idx)} fit tokens: {time.perf_counter() - t0:.0f} s", flush=True)
    weights = {}
    for name, cols in variants.items():
        t1 = time.perf_counter()
        for d in (1, 2, 3):
            for t in range(d, n_layer):
                X = stack(cols, F, d, t)
                sel = trace.multi_hot(fit_idx, t, np.float32)
                if ":mlp" in name:
                    hidden = int(name.split(":mlp")[1])
                    weights[name, d, t] = fit_mlp(torch, X, sel, hidden, max_iter=args.mlp_iter)
                else:
                    weights[name, d, t] = fit_weights(torch, X, sel, max_iter=args.max_iter)
        print(f"fits of {name} ({len(cols)} features): {time.perf_counter() - t1:.0f} s", flush=True)
    del F
    recalls = {name: {d: [] for d in (1, 2, 3)} for name in variants}
    first, end = args.test_seqs
    for s0 in range(first, end, args.chunk):
        s1 = min(s0 + args.chunk, end)
        rows = sequences_slice(trace, s0, s1)
        F = all_features(torch, trace, rows, dt, need, args.cache, f"test{s0}-{s1}", not args.cache_readonly)
        for d in (1, 2, 3):
            for t in range(d, n_layer):
                sel = trace.multi_hot(rows, t, np.float32)
                for name, cols in variants.items():
                    recalls[name][d].append(
                        recall_rows(score(weights[name, d, t], stack(cols, F, d, t)), sel, k)
                    )
        del F
        if s1 == args.also_report:
            for name in variants:
                cells = " ".join(f"{np.concatenate(recalls[name][d]).mean():.4f}" for d in (1, 2, 3))
                print(f"[{first}, {s1}) {name:12s} recall@k d=1,2,3: {cells}", flush=True)
        print(f"scored [{first}, {s1}): {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"held-out sequences [{first}, {end}) scored: {time.perf_counter() - t0:.0f} s in all")
    for name in variants:
        cells = " ".join(f"{np.concatenate(recalls[name][d]).mean():.4f}" for d in (1, 2, 3))
        print(f"{name:12s} recall@k d=1,2,3: {cells}", flush=True)
    if args.cache and not args.cache_readonly:
        with open(os.path.join(args.cache, f"weights-{tag}.pkl"), "wb") as f:
            pickle.dump(weights, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
