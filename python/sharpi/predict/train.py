"""Training of the sidecar predictors (cooc, learned, trajectory) and of pre-gate weights.

What it owns: turning the TRAIN token indices of a trace into predictor parameters. It only ever
reads the tokens it is given (the caller passes the train split; every validation slice used for
tuning is carved out of those same train sequences, never out of the eval ones), returns a Sidecar
(the caller writes it) or, for pregate, writes a copy of the model file next to the original,
leaving the original untouched.

torch is an optional dependency, imported only by train_learned / train_trajectory
(`pip install sharpi[torch]`); they run single-threaded unless told otherwise, because the machines
this runs on are shared.
"""

from __future__ import annotations

import math
import os
import sys
import time

import numpy as np

from .sidecar import Sidecar
from .traces import RoutingTrace, ids_to_multi_hot

# ------------------------------------------------------------------------------------------------
# Shared helpers
# ------------------------------------------------------------------------------------------------


def _invalid(message: str) -> Exception:
    from sharpi._core import InvalidArgument

    return InvalidArgument(message)


def _log(message: str, quiet: bool) -> None:
    if not quiet:
        print(message, file=sys.stderr, flush=True)


def validation_cut(trace: RoutingTrace, train_idx: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Splits the train tokens by sequence: the last `fraction` of the train sequences validate.
    With a single train sequence it falls back to the last `fraction` of its tokens."""
    starts = np.intersect1d(trace.seq_start, train_idx)
    if len(starts) >= 2:
        n_fit = min(max(int(round(len(starts) * (1 - fraction))), 1), len(starts) - 1)
        cut = starts[n_fit]
    else:
        cut = train_idx[int(len(train_idx) * (1 - fraction))]
    return train_idx[train_idx < cut], train_idx[train_idx >= cut]


def _torch(num_threads: int | None):
    try:
        import torch
    except ImportError:
        from sharpi._core import UnsupportedError

        raise UnsupportedError("training this predictor needs torch: pip install 'sharpi[torch]'") from None
    torch.set_num_threads(num_threads or 1)
    return torch


def _recall(scores: np.ndarray, sel_hot: np.ndarray, k: int) -> float:
    """Mean |top-k ∩ S| / |S| over rows (scores and sel_hot [..., E]); ties do not matter here."""
    top = np.argpartition(-scores, k - 1, axis=-1)[..., :k]
    hit = np.take_along_axis(sel_hot, top, axis=-1).sum(axis=-1)
    n_sel = sel_hot.sum(axis=-1)
    ok = n_sel > 0
    return float((hit[ok] / n_sel[ok]).mean())


# ------------------------------------------------------------------------------------------------
# cooc: count tables
# ------------------------------------------------------------------------------------------------


def _cooc_tables(trace: RoutingTrace, idx: np.ndarray, n_off: int, smoothing: float):
    """Log-prior and log conditional-ratio tables from token counts (float64).

    bias[t, j]          = log p_t(j), p_t(j) = (count of j at t + 1) / (N + E)  (P(j in S(t)))
    layer[t, o-1, i, j] = log q(j | i) - log p_t(j), q = (C_ij + s p_t(j)) / (n_i + s)
                          with C_ij = #tokens with i in S(t-o) and j in S(t), n_i = #tokens with i in S(t-o)
    prev[t, i, j]       = the same with i in P(t) (tokens that have a previous token)
    The smoothing s pulls rare source experts toward ratio 1 (log 0)."""
    E, n_layer = trace.n_expert, trace.n_layer
    hot = [trace.multi_hot(idx, layer, dtype=np.float64) for layer in range(n_layer)]
    prev = trace.prev_index()[idx]
    has_prev = prev >= 0
    prev_hot = [trace.multi_hot(prev[has_prev], layer) for layer in range(n_layer)]
    N = len(idx)
    bias = np.zeros((n_layer, E))
    layer_tab = np.zeros((n_layer, n_off, E, E))
    prev_tab = np.zeros((n_layer, E, E))
    for t in range(n_layer):
        p = (hot[t].sum(axis=0) + 1.0) / (N + E)
        bias[t] = np.log(p)

        def ratio(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
            C = src.T @ dst
            n_i = src.sum(axis=0)[:, None]
            return np.log((C + smoothing * p) / (n_i + smoothing)) - np.log(p)

        for o in range(1, n_off + 1):
            if t - o >= 0:
                layer_tab[t, o - 1] = ratio(hot[t - o], hot[t])
        if has_prev.any():
            prev_tab[t] = ratio(prev_hot[t], hot[t][has_prev])
    return bias, layer_tab, prev_tab


def train_cooc(
    trace: RoutingTrace,
    train_idx: np.ndarray,
    max_lookahead: int = 3,
    histories: tuple[int, ...] = (1, 2, 3),
    val_fraction: float = 0.15,
    val_tokens: int = 3000,
    smoothing: float = 20.0,
    seed: int = 0,
    source: str = "",
    quiet: bool = False,
) -> Sidecar:
    """Count-based co-occurrence predictor. The history m and one weight per term (bias, each layer
    offset o, previous token) are tuned by coordinate ascent on mean recall@k over d = 1..max_lookahead,
    on a validation slice carved from the last `val_fraction` of the TRAIN sequences (tables fitted on
    the rest); the final tables are refitted on all train tokens and the weights baked into them."""
    if not 1 <= max_lookahead <= 3:
        raise _invalid(f"max_lookahead {max_lookahead} outside 1..3")
    t0 = time.perf_counter()
    E, k, n_layer = trace.n_expert, trace.top_k, trace.n_layer
    fit_idx, val_idx = validation_cut(trace, np.asarray(train_idx, dtype=np.int64), val_fraction)
    rng = np.random.default_rng(seed)
    if len(val_idx) > val_tokens:
        val_idx = np.sort(rng.choice(val_idx, size=val_tokens, replace=False))
    n_off_max = max_lookahead + max(histories) - 1
    bias, layer_tab, prev_tab = _cooc_tables(trace, fit_idx, n_off_max, smoothing)

    # Weight-independent pieces of the validation scores, per target layer t (float32 to save memory).
    Nv = len(val_idx)
    v_hot = np.stack([trace.multi_hot(val_idx, t) for t in range(n_layer)])  # [n_layer, Nv, E]
    v_prev = trace.prev_index()[val_idx]
    v_bias = np.broadcast_to(bias[:, None, :], (n_layer, Nv, E)).astype(np.float32)
    v_layer = np.zeros((n_off_max, n_layer, Nv, E), dtype=np.float32)
    for o in range(1, n_off_max + 1):
        for t in range(o, n_layer):
            v_layer[o - 1, t] = v_hot[t - o] @ layer_tab[t, o - 1]
    v_prevs = np.stack([trace.multi_hot(v_prev, t) @ prev_tab[t] for t in range(n_layer)]).astype(np.float32)

    def objective(m: int, w: np.ndarray) -> float:
        # w = [w_bias, w_prev, w_o for o = 1..n_off_max]
        total = 0.0
        for d in range(1, max_lookahead + 1):
            s = w[0] * v_bias[d:] + w[1] * v_prevs[d:]
            for o in range(d, d + m):
                if w[1 + o] != 0:
                    s = s + w[1 + o] * v_layer[o - 1, d:]
            total += _recall(s, v_hot[d:], k)
        return total / max_lookahead

    grid = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
    best = (-1.0, histories[0], None)
    for m in histories:
        w = np.ones(2 + n_off_max)
        w[2 + max_lookahead + m - 1:] = 0.0  # offsets this m never uses
        score = objective(m, w)
        for _ in range(2):
            improved = False
            for j in range(2 + max_lookahead + m - 1):
                for g in grid:
                    if g == w[j]:
                        continue
                    trial = w.copy()
                    trial[j] = g
                    s = objective(m, trial)
                    if s > score + 1e-6:
                        score, w, improved = s, trial, True
            if not improved:
                break
        _log(f"cooc: history m={m}: validation recall@k {score:.4f} weights bias {w[0]:g} prev {w[1]:g} "
             f"offsets {w[2:2 + max_lookahead + m - 1].tolist()}", quiet)
        if score > best[0]:
            best = (score, m, w)
    score, m, w = best
    n_off = max_lookahead + m - 1
    bias, layer_tab, prev_tab = _cooc_tables(trace, np.asarray(train_idx, dtype=np.int64), n_off, smoothing)
    tensors = {
        "cooc.bias": (w[0] * bias).astype(np.float32),
        "cooc.layer": (layer_tab * w[2:2 + n_off][None, :, None, None]).astype(np.float32),
        "cooc.prev": (w[1] * prev_tab).astype(np.float32),
    }
    _log(f"cooc: chose history {m} (validation recall@k {score:.4f} on {Nv} tokens); "
         f"trained in {time.perf_counter() - t0:.1f} s", quiet)
    return Sidecar("cooc", n_layer, E, k, max_lookahead,
                   source or f"{trace.path}: {len(train_idx)} train tokens", {"cooc.history": m}, tensors)
