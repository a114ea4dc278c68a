"""Evaluation of a predictor on held-out routing: prediction quality and a prefetch cache simulation.

What it owns: the metric definitions (below) and the LRU simulation; it reads a trace and calls a
reference predictor, never writes files (the CLI does), never trains.

Metrics, per lookahead d (the predictor, at source layer L, predicts target layer t = L + d), over
every eval token and every target layer t in [d, n_layer), and per target layer:
  - top1: the best-scored expert is among the selected ones;
  - recall_at_k: |P ∩ S| / |S| with P the top-k predicted set and S the selected set (|S| = k when
    the trace row is complete);
  - jaccard: |P ∩ S| / |P ∪ S|;   perfect: every selected expert was predicted (P == S for full rows).
Rows with -1 (missing) cells are scored on their known ids only; rows with no known id are skipped.
A predictor row of -inf ("no prediction", e.g. prev_token on a sequence's first token) counts as an
empty P: it scores 0 on every metric.

Cache simulation, per target layer t: an LRU cache of `cache_experts` experts fed by the eval tokens in
file order (sequences back to back, as a server sees them), each token touching its selected set. LRU
content is "the C most recently used experts" (ties inside one token to the lower id), so it is
computed in closed form from each expert's last use instead of a per-token loop. With a predictor at
lookahead d, the prefetcher stages P minus what is cached (prefetch never evicts); when the gate fires,
a selected expert that is staged is a demand miss avoided (bytes_saved), a staged expert nobody
selected is dropped (bytes_wasted). Staged experts are adopted into the cache only when selected, and
the selected set is touched either way, so the cache contents are the same with and without a
predictor: one simulation per layer serves every d. `miss_bytes` is the no-predictor demand traffic.
"""

from __future__ import annotations

import numpy as np

from .reference import ReferencePredictor, predicted_sets
from .traces import RoutingTrace, ids_to_multi_hot

METRICS = ("top1", "recall_at_k", "jaccard", "perfect")


def _invalid(message: str) -> Exception:
    from sharpi._core import InvalidArgument

    return InvalidArgument(message)


def lru_cached_before(selected: np.ndarray, n_expert: int, capacity: int) -> np.ndarray:
    """selected int [N, k] (-1 = none), tokens in access order -> bool [N, n_expert]: which experts an
    LRU cache of `capacity` holds just before token i's access (empty before token 0)."""
    N = selected.shape[0]
    used = ids_to_multi_hot(selected, n_expert, dtype=bool)
    stamp = np.where(used, np.arange(N, dtype=np.int64)[:, None], -1)
    last_use = np.maximum.accumulate(stamp, axis=0)  # last use at or before i
    last_use = np.vstack([np.full((1, n_expert), -1, np.int64), last_use[:-1]])  # strictly before i
    # Unique recency key: newer use first, then the lower id (the tie rule inside one token).
    key = np.where(last_use >= 0, last_use * n_expert + (n_expert - 1 - np.arange(n_expert)), -1)
    cached = np.zeros((N, n_expert), dtype=bool)
    if capacity >= n_expert:
        return last_use >= 0
    top = np.argpartition(-key, capacity - 1, axis=1)[:, :capacity]
    np.put_along_axis(cached, top, True, axis=1)
    return cached & (last_use >= 0)


def _set_metrics(pred: np.ndarray, sel: np.ndarray, n_expert: int) -> dict[str, np.ndarray]:
    """Per-row metrics of predicted sets pred int [N, k] against selected sel int [N, k] (-1 = none).
    Returns arrays over the rows that have at least one known selected id, and that row mask."""
    p_hot = ids_to_multi_hot(pred, n_expert, dtype=bool)
    s_hot = ids_to_multi_hot(sel, n_expert, dtype=bool)
    n_sel = s_hot.sum(axis=1)
    keep = n_sel > 0
    inter = (p_hot & s_hot).sum(axis=1)
    union = (p_hot | s_hot).sum(axis=1)
    best = pred[:, 0]
    top1 = (best >= 0) & s_hot[np.arange(len(best)), np.maximum(best, 0)]
    return {
        "keep": keep,
        "top1": top1[keep].astype(np.float64),
        "recall_at_k": inter[keep] / n_sel[keep],
        "jaccard": inter[keep] / union[keep],
        "perfect": (inter[keep] == n_sel[keep]).astype(np.float64),
        "p_hot": p_hot,
        "s_hot": s_hot,
    }


def evaluate(
    predictor: ReferencePredictor,
    trace: RoutingTrace,
    idx: np.ndarray,
    lookaheads: tuple[int, ...] = (1, 2, 3),
    cache_experts: int | None = None,
    expert_bytes: float = 1.0,
) -> dict:
    """Scores `predictor` on the tokens idx (global indices, in access order) of `trace`.

    Returns {"rows": [per d: d, n, top1, recall_at_k, jaccard, perfect, bytes_saved, bytes_wasted,
    miss_bytes, hit_rate, hit_rate_with_prefetch], "per_layer": {d: [per target layer: layer, n, ...]},
    "cache_experts", "expert_bytes", "lru_hit_rate"}. Lookaheads beyond predictor.max_lookahead get a
    row with n = 0 and None metrics."""
    predictor.check_trace(trace)
    idx = np.asarray(idx, dtype=np.int64)
    E, k, n_layer = trace.n_expert, trace.top_k, trace.n_layer
    C = max(E // 4, k) if cache_experts is None else int(cache_experts)
    if not k <= C <= E:
        raise _invalid(f"cache size {C} experts per layer must lie in [top_k={k}, n_expert={E}]")
    if len(idx) == 0:
        raise _invalid("evaluation needs at least one token")
    for d in lookaheads:
        if not 1 <= d <= 3:
            raise _invalid(f"lookahead {d} outside 1..3")

    sel = {t: trace.selected(idx, t) for t in range(n_layer)}
    cached = {t: lru_cached_before(sel[t], E, C) for t in range(n_layer)}
    sums = {d: {m: 0.0 for m in METRICS} | {"n": 0, "saved": 0, "wasted": 0} for d in lookaheads}
    per_layer: dict[int, list[dict]] = {d: [] for d in lookaheads}
    for L in range(n_layer - 1):
        need = [d for d in lookaheads if d <= predictor.max_lookahead and L + d < n_layer]
        if not need:
            continue
        all_scores = predictor.scores_all(trace, idx, L)
        for d in need:
            t = L + d
            m = _set_metrics(predicted_sets(all_scores[d - 1], k), sel[t], E)
            staged = m["p_hot"] & ~cached[t] & m["keep"][:, None]  # rows with no known id are skipped
            saved = int((staged & m["s_hot"]).sum())
            wasted = int((staged & ~m["s_hot"]).sum())
            n = int(m["keep"].sum())
            row = {
                "layer": t,
                "n": n,
                "bytes_saved": saved * expert_bytes,
                "bytes_wasted": wasted * expert_bytes,
            }
            for name in METRICS:
                row[name] = float(m[name].mean()) if n else None
                sums[d][name] += float(m[name].sum())
            sums[d]["n"] += n
            sums[d]["saved"] += saved
            sums[d]["wasted"] += wasted
            per_layer[d].append(row)

    rows = []
    for d in lookaheads:
        s, n = sums[d], sums[d]["n"]
        targets = range(d, n_layer)
        accesses = sum(int((sel[t] >= 0).sum()) for t in targets)
        hits = sum(int((ids_to_multi_hot(sel[t], E, dtype=bool) & cached[t]).sum()) for t in targets)
        row = {"d": d, "n": n}
        for name in METRICS:
            row[name] = s[name] / n if n else None
        row["bytes_saved"] = s["saved"] * expert_bytes if n else None
        row["bytes_wasted"] = s["wasted"] * expert_bytes if n else None
        row["miss_bytes"] = (accesses - hits) * expert_bytes
        row["hit_rate"] = hits / accesses if accesses else None
        row["hit_rate_with_prefetch"] = (hits + s["saved"]) / accesses if (accesses and n) else None
        rows.append(row)
    all_acc = sum(int((sel[t] >= 0).sum()) for t in range(n_layer))
    all_hit = sum(int((ids_to_multi_hot(sel[t], E, dtype=bool) & cached[t]).sum()) for t in range(n_layer))
    return {
        "predictor": predictor.name,
        "rows": rows,
        "per_layer": per_layer,
        "cache_experts": C,
        "expert_bytes": expert_bytes,
        "lru_hit_rate": all_hit / all_acc if all_acc else None,
        "n_tokens": len(idx),
    }


def format_table(result: dict) -> str:
    """The human table: rows d = 1..3, the metric columns."""
    cols = ("top1", "recall_at_k", "jaccard", "perfect", "bytes_saved", "bytes_wasted", "miss_bytes")
    head = f"{'d':>2} " + " ".join(f"{c:>12}" for c in cols)
    lines = [head]
    for r in result["rows"]:
        cells = []
        for c in cols:
            v = r[c]
            if v is None:
                cells.append(f"{'-':>12}")
            elif c in METRICS:
                cells.append(f"{v:12.4f}")
            else:
                cells.append(f"{v:12.6g}")
        lines.append(f"{r['d']:>2} " + " ".join(cells))
    lines.append(
        f"LRU cache {result['cache_experts']} experts/layer, {result['expert_bytes']:g} bytes/expert: "
        f"hit rate without prefetch {result['lru_hit_rate']:.4f}"
    )
    return "\n".join(lines)
