"""Softmax regression over the routing history: depth (the current token's choices at every earlier
layer) and time (the previous token's choices at the target and nearby layers).

What it owns: one convex fit, `fit_history_regression`, shared by two users so they cannot drift:
  - the `softmax regression` baseline of `sharpi predictor eval` (previous token at the target layer
    only; written in the `cooc` sidecar format with a history of every earlier layer), and
  - the `depthtime` predictor (previous token at t-1, t, t+1; its score is one feature of a per-(d, t)
    linear stacker, `fit_depthtime_stack`, fitted on held-out TRAINING sequences over depth and time
    features (the co-occurrence counts of layer t-d, the previous tokens, decayed counts, route votes
    of the sequence's earlier tokens and of a pool of training tokens: reference.DepthTimePredictor), which keeps a single feature instead wherever that recalls better
    there, so on every target layer it is at least as good as the best of its members on those
    sequences).

The model, for target layer t and distance d (source layer L = t - d):

    score_{t,d} = bias[t] + sum_{l=0}^{L} sum_{i in S(l)} layer[t, t-l-1, i]
                          + sum_{r in offsets, 0 <= t+r < n_layer} sum_{i in P(t+r)} prev[t, r, i]

trained by Adam on the softmax cross-entropy against the selected set (each selected expert 1/|S|)
plus an L2 penalty, summed over d = 1..max_lookahead; the loss is convex in the tables. The tables
are shared by every d (as in cooc), so one fit serves every lookahead. The epoch with the best
validation recall@k is kept. torch is imported only here (optional dependency, `sharpi[torch]`);
the fit runs on the threads it is given (1 by default: the machines are shared).
"""

from __future__ import annotations

import numpy as np

from .sidecar import Sidecar, depthtime_features
from .traces import RoutingTrace
from .train import _invalid, _log, _recall, _torch, fit_best_epoch, validation_rows

DEPTHTIME_PREV_OFFSETS = (-1, 0, 1)  # previous token's layers t-1, t, t+1 (docs/predictors.md)
# The pool votes: at most this many training tokens' routes kept in the sidecar (a seeded sample of
# the regression's fit rows beyond it; 4 bytes per layer and slot each), and the neighbours that vote.
DEPTHTIME_POOL_TOKENS = 100_000
DEPTHTIME_NEIGHBOURS = 1024


def _ids(torch, trace: RoutingTrace, idx: np.ndarray) -> tuple:
    """The selected ids of the tokens idx and of their previous tokens, as (ids long [n_layer, N, k]
    clamped to >= 0, weight float32 [n_layer, N, k]: 1 for a known id, 0 for a missing one or for a
    sequence's first token's previous token)."""
    prev = trace.prev_index()[idx]
    out = []
    for rows in (np.asarray(idx, dtype=np.int64), prev):
        ids = np.stack([trace.selected(rows, t) for t in range(trace.n_layer)])
        out += [torch.from_numpy(np.maximum(ids, 0)), torch.from_numpy((ids >= 0).astype(np.float32))]
    return tuple(out)


def _bag(torch, table, ids, weight):
    """sum_j weight[..., j] * table[ids[..., j]]: table [R, E], ids / weight [..., k] -> [..., E]."""
    k = ids.shape[-1]
    out = torch.nn.functional.embedding_bag(
        ids.reshape(-1, k), table, per_sample_weights=weight.reshape(-1, k), mode="sum"
    )
    return out.reshape(*ids.shape[:-1], table.shape[1])


def _target_scores(torch, params: dict, feats: tuple, t: int, offsets, max_lookahead: int) -> list:
    """Scores [N, E] of target layer t for d = 1..min(max_lookahead, t) from feats = _ids(...).
    params: per target layer (lists indexed by t, so a batch's gradient touches only its own tables)
    "bias" [E], "layer" [t, E, E] (row o-1 = offset o = t - l), "prev" [len(offsets), E, E]."""
    cur, cur_w, prv, prv_w = feats
    n_layer, E = cur.shape[0], params["bias"][t].shape[0]
    base = params["bias"][t]
    for r_i, r in enumerate(offsets):
        if 0 <= t + r < n_layer:
            base = base + _bag(torch, params["prev"][t][r_i], prv[t + r], prv_w[t + r])
    # Per-source-layer contributions C[l] = sum_{i in S(l)} layer[t, t-l-1, i], l = 0..t-1, then the
    # prefix sums: score_{t,d} adds C[0..t-d].
    off = torch.arange(t - 1, -1, -1)[:, None, None] * E  # row block of offset t-l for l = 0..t-1
    contrib = _bag(torch, params["layer"][t].reshape(-1, E), cur[:t] + off, cur_w[:t])  # [t, N, E]
    csum = torch.cumsum(contrib, dim=0)
    return [base + csum[t - d] for d in range(1, min(max_lookahead, t) + 1)]


def fit_history_regression(
    trace: RoutingTrace,
    fit_idx: np.ndarray,
    val_idx: np.ndarray,
    max_lookahead: int = 3,
    prev_offsets: tuple[int, ...] = (0,),
    epochs: int = 6,
    batch: int = 1024,
    lr: float = 0.01,
    l2: float = 1e-6,
    seed: int = 0,
    num_threads: int | None = 1,
    quiet: bool = False,
    name: str = "regression",
) -> tuple[dict[str, np.ndarray], float]:
    """The convex fit above on fit_idx; the epoch with the best mean recall@k (over d and t) on val_idx
    is kept. Returns ({"bias" [n_layer, E], "layer" [n_layer, n_layer-1, E, E], "prev" [n_layer,
    len(prev_offsets), E, E]} as float64, that recall)."""
    torch = _torch(num_threads)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    n_layer, E, k = trace.n_layer, trace.n_expert, trace.top_k
    if n_layer < 2:
        raise _invalid(f"trace {trace.path}: a history regression needs at least 2 MoE layers")
    f = _ids(torch, trace, fit_idx)
    v = _ids(torch, trace, val_idx)
    v_hot = [trace.multi_hot(val_idx, t) for t in range(n_layer)]
    counts = torch.from_numpy(np.stack([trace.multi_hot(fit_idx, t).sum(axis=0) for t in range(n_layer)]))
    log_prior = torch.log((counts + 1.0) / (len(fit_idx) + E)).float()
    params = {
        "bias": [log_prior[t].clone().requires_grad_() for t in range(n_layer)],
        "layer": [torch.zeros(max(t, 1), E, E, requires_grad=True) for t in range(n_layer)],
        "prev": [torch.zeros(len(prev_offsets), E, E, requires_grad=True) for t in range(n_layer)],
    }
    opt = torch.optim.Adam([p for group in params.values() for p in group[1:]], lr=lr)

    def snapshot() -> dict:
        return {n: [p.detach().clone() for p in group] for n, group in params.items()}

    def val_recall() -> float:
        with torch.no_grad():
            rec = [
                _recall(s.numpy(), v_hot[t], k)
                for t in range(1, n_layer)
                for s in _target_scores(torch, params, v, t, prev_offsets, max_lookahead)
            ]
        return float(np.mean(rec))

    def adam_step(rows: np.ndarray) -> None:
        b = tuple(x[:, torch.from_numpy(rows)] for x in f)
        loss = 0.0
        for t in range(1, n_layer):
            target = torch.zeros(len(rows), E).scatter_add_(1, b[0][t], b[1][t])
            n_sel = target.sum(dim=1, keepdim=True)
            ok = n_sel[:, 0] > 0
            target = target[ok] / n_sel[ok]
            for s in _target_scores(torch, params, b, t, prev_offsets, max_lookahead):
                loss = loss - (target * torch.log_softmax(s[ok], dim=1)).sum(dim=1).mean()
        loss = loss + l2 * sum(p.square().sum() for n in ("layer", "prev") for p in params[n][1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    batch = max(32, min(batch, len(fit_idx) // 20))  # at least ~20 steps an epoch on small traces
    best = fit_best_epoch(len(fit_idx), batch, epochs, rng, adam_step, val_recall, snapshot, name, quiet)
    kept = best[1]
    layer = np.zeros((n_layer, max(n_layer - 1, 1), E, E))
    for t in range(1, n_layer):
        layer[t, :t] = kept["layer"][t].numpy()
    return {
        "bias": np.stack([b.numpy() for b in kept["bias"]]).astype(np.float64),
        "layer": layer,
        "prev": np.stack([p.numpy() for p in kept["prev"]]).astype(np.float64),
    }, best[0]


def _as_params(torch, p: dict) -> dict:
    """The arrays fit_history_regression returns, in the per-target form _target_scores reads."""
    return {
        n: [torch.from_numpy(np.ascontiguousarray(v[t], dtype=np.float32)) for t in range(len(v))]
        for n, v in p.items()
    }


def train_regression_baseline(
    trace: RoutingTrace,
    train_idx: np.ndarray,
    max_lookahead: int = 3,
    val_fraction: float = 0.15,
    val_tokens: int = 4000,
    seed: int = 0,
    num_threads: int | None = 1,
    source: str = "",
    quiet: bool = False,
    **fit_kw,
) -> Sidecar:
    """The `softmax regression` baseline: every earlier layer of the current token plus the previous
    token at the target layer, as a cooc sidecar (history = every earlier layer)."""
    fit_idx, val_idx = validation_rows(trace, train_idx, val_fraction, val_tokens, np.random.default_rng(seed))
    p, _ = fit_history_regression(
        trace,
        fit_idx,
        val_idx,
        max_lookahead,
        (0,),
        seed=seed,
        num_threads=num_threads,
        quiet=quiet,
        name="softmax regression",
        **fit_kw,
    )
    n_layer, E = trace.n_layer, trace.n_expert
    m = max(n_layer - 1, 1)
    layer = np.zeros((n_layer, max_lookahead + m - 1, E, E))
    layer[:, :m] = p["layer"]
    return Sidecar(
        "cooc",
        n_layer,
        E,
        trace.top_k,
        max_lookahead,
        source or f"{trace.path}: {len(train_idx)} train tokens (softmax regression baseline)",
        {"cooc.history": m},
        {
            "cooc.bias": p["bias"].astype(np.float32),
            "cooc.layer": layer.astype(np.float32),
            "cooc.prev": p["prev"][:, 0].astype(np.float32),
        },
    )


def fit_stack_weights(torch, X: np.ndarray, sel_hot: np.ndarray, k: int, l2: float = 1e-3) -> tuple[np.ndarray, float]:
    """The weights of one (d, t) of the depthtime stacker. X float64 [N, E, F] features, sel_hot
    [N, E] the selected sets. Fits w by L-BFGS on the softmax cross-entropy of X @ w against
    sel_hot / |S| (rows with an empty S skipped) plus l2 * |w|^2 on standardised features, then
    keeps whichever of that fit and each feature alone (a unit weight) recalls best on these rows
    (ties: the fit), so the stacker is never worse here than any of its members. Returns (w float64
    [F], recall@k)."""
    ok = sel_hot.sum(axis=1) > 0
    Xt = torch.from_numpy(X[ok])
    Y = torch.from_numpy(sel_hot[ok] / sel_hot[ok].sum(axis=1, keepdims=True))
    scale = Xt.reshape(-1, Xt.shape[-1]).std(dim=0) + 1e-6
    Z = Xt / scale  # once: L-BFGS evaluates the loss up to ~50 times, and X is [N, E, F] float64
    w = torch.zeros(Xt.shape[-1], dtype=Xt.dtype, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=40, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = -(Y * torch.log_softmax(Z @ w, dim=1)).sum(dim=1).mean() + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    fitted = (w.detach() / scale).numpy()
    best = (fitted, _recall(X @ fitted, sel_hot, k))
    for f in range(X.shape[-1]):
        r = _recall(X[:, :, f], sel_hot, k)
        if r > best[1] + 1e-9:
            best = (np.eye(X.shape[-1])[f], r)
    return best


def fit_depthtime_stack(
    trace: RoutingTrace, val_idx: np.ndarray, tables: dict[str, np.ndarray], max_lookahead: int,
    num_threads: int | None = 1, quiet: bool = False, routers=None, neighbours: int = DEPTHTIME_NEIGHBOURS,
) -> np.ndarray:
    """dt.stack float32 [max_lookahead, n_layer, F] for the trained tables (dt.bias, dt.layer,
    dt.prev, dt.count_bias, dt.count, and dt.pool when given: the pool votes with `neighbours`),
    fitted per (d, t) by fit_stack_weights on the validation rows val_idx (held-out TRAINING tokens
    the tables never saw and the pool does not hold; their features see the whole sequence prefix).
    Rows t < d are never used and stay 0. routers (reference.ModelRouters): also the gate feature,
    from the trace's hidden states. F = len(depthtime_features) of such a sidecar."""
    from .reference import DepthTimePredictor

    torch = _torch(num_threads)
    n_layer, k = trace.n_layer, trace.top_k
    params = _depthtime_params(routers, tables.get("dt.pool"), neighbours)
    sc = Sidecar("depthtime", n_layer, trace.n_expert, k, max_lookahead, "", params)
    n_features = len(depthtime_features(sc))
    stack = np.zeros((max_lookahead, n_layer, n_features))
    sc.tensors = dict(tables, **{"dt.stack": stack})
    ref = DepthTimePredictor(sc, routers)
    ref.check_trace(trace)
    total, alone = 0.0, 0
    for L in range(n_layer - 1):  # ascending L: the reference adds one layer of route counts per step
        for t, X in ref.features(trace, val_idx, L).items():
            stack[t - L - 1, t], r = fit_stack_weights(torch, X, trace.multi_hot(val_idx, t), k)
            total += r
            alone += int(np.count_nonzero(stack[t - L - 1, t]) == 1)
    n = sum(max(n_layer - d, 0) for d in range(1, max_lookahead + 1))
    _log(
        f"depthtime: stacker over {n_features} features fitted on {len(val_idx)} validation tokens, "
        f"mean validation recall@k {total / max(n, 1):.4f} (one feature alone kept on {alone} of {n} targets)",
        quiet,
    )
    return stack.astype(np.float32)


def _depthtime_params(routers, pool: np.ndarray | None, neighbours: int) -> dict[str, int]:
    n_pool = 0 if pool is None else int(pool.shape[0])
    return {"depthtime.gate": int(routers is not None), "depthtime.pool": n_pool,
            "depthtime.neighbours": neighbours if n_pool else 0}


def train_depthtime(
    trace: RoutingTrace,
    train_idx: np.ndarray,
    max_lookahead: int = 3,
    val_fraction: float = 0.15,
    val_tokens: int = 4000,
    seed: int = 0,
    num_threads: int | None = 1,
    source: str = "",
    quiet: bool = False,
    routers=None,
    pool_tokens: int = DEPTHTIME_POOL_TOKENS,
    neighbours: int = DEPTHTIME_NEIGHBOURS,
    **fit_kw,
) -> Sidecar:
    """The depthtime predictor (docs/predictors.md): the regression with the previous token at t-1,
    t, t+1 and the co-occurrence counts, fitted on the train sequences minus the last `val_fraction`
    of them; those held-out TRAINING sequences then fit the per-(d, t) stacker over every feature
    (fit_depthtime_stack). routers (reference.ModelRouters of the traced model, on a trace with
    hidden states): the stacker also weighs the gate feature (depthtime.gate = 1). pool_tokens > 0:
    the routes of the regression's fit rows (a seeded sample of pool_tokens when there are more)
    go into the sidecar for the pool votes of `neighbours` neighbours; 0: no pool votes."""
    if pool_tokens < 0 or (pool_tokens > 0 and neighbours < 1):
        raise _invalid(f"pool_tokens {pool_tokens} must be >= 0 and neighbours {neighbours} >= 1 with a pool")
    if not 1 <= max_lookahead <= 3:
        raise _invalid(f"max_lookahead {max_lookahead} outside 1..3")
    fit_idx, val_idx = validation_rows(trace, train_idx, val_fraction, val_tokens, np.random.default_rng(seed))
    p, _ = fit_history_regression(
        trace,
        fit_idx,
        val_idx,
        max_lookahead,
        DEPTHTIME_PREV_OFFSETS,
        seed=seed,
        num_threads=num_threads,
        quiet=quiet,
        name="depthtime",
        **fit_kw,
    )
    from .train import _cooc_tables

    n_layer, E, k = trace.n_layer, trace.n_expert, trace.top_k
    count_bias, count, _ = _cooc_tables(trace, fit_idx, max_lookahead, 20.0)
    tables = {
        "dt.bias": p["bias"].astype(np.float32),
        "dt.layer": p["layer"].astype(np.float32),
        "dt.prev": p["prev"].astype(np.float32),
        "dt.count_bias": count_bias.astype(np.float32),
        "dt.count": count.astype(np.float32),
    }
    if pool_tokens > 0 and len(fit_idx) > 0:
        pool_idx = fit_idx
        if len(pool_idx) > pool_tokens:
            pool_idx = np.sort(np.random.default_rng(seed + 1).choice(pool_idx, size=pool_tokens, replace=False))
        tables["dt.pool"] = np.stack([trace.selected(pool_idx, layer) for layer in range(n_layer)], axis=1).astype(np.float32)
    stack = fit_depthtime_stack(trace, val_idx, tables, max_lookahead, num_threads, quiet, routers, neighbours)
    return Sidecar(
        "depthtime",
        n_layer,
        E,
        k,
        max_lookahead,
        source or f"{trace.path}: {len(train_idx)} train tokens",
        _depthtime_params(routers, tables.get("dt.pool"), neighbours),
        dict(tables, **{"dt.stack": stack}),
    )


def count_cooc_baseline(trace: RoutingTrace, train_idx: np.ndarray, max_lookahead: int = 3) -> Sidecar:
    """The `cross-layer co-occurrence` baseline: layer t from layer t-d alone, by the count tables of
    train._cooc_tables (log prior + log conditional ratio), no previous token, nothing tuned."""
    from .train import _cooc_tables

    bias, layer_tab, _ = _cooc_tables(trace, np.asarray(train_idx, dtype=np.int64), max_lookahead, 20.0)
    E = trace.n_expert
    return Sidecar(
        "cooc",
        trace.n_layer,
        E,
        trace.top_k,
        max_lookahead,
        f"{trace.path}: co-occurrence counts baseline",
        {"cooc.history": 1},
        {
            "cooc.bias": bias.astype(np.float32),
            "cooc.layer": layer_tab.astype(np.float32),
            "cooc.prev": np.zeros((trace.n_layer, E, E), dtype=np.float32),
        },
    )


BASELINES = ("prev_token", "cooc_counts", "softmax_regression")


def baseline_predictors(trace: RoutingTrace, train_idx: np.ndarray, quiet: bool = True) -> list:
    """[(name, ReferencePredictor)] for BASELINES, trained on train_idx of `trace` (the softmax
    regression carves its epoch-choosing validation out of those same sequences)."""
    from .reference import CoocPredictor, PrevTokenPredictor

    return [
        ("prev_token", PrevTokenPredictor(trace.n_expert)),
        ("cooc_counts", CoocPredictor(count_cooc_baseline(trace, train_idx))),
        ("softmax_regression", CoocPredictor(train_regression_baseline(trace, train_idx, quiet=quiet))),
    ]
