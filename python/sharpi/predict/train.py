"""Training of the sidecar predictors (cooc, learned, trajectory) and of pre-gate weights.

What it owns: turning the TRAIN token indices of a trace into predictor parameters. It only ever
reads the tokens it is given (the caller passes the train split; every validation slice used for
tuning is carved out of those same train sequences, never out of the eval ones), returns a Sidecar
(the caller writes it) or, for pregate, writes a copy of the model file next to the original,
leaving the original untouched.

torch is an optional dependency, imported only by train_learned / train_trajectory
(`pip install sharpi[torch]`); they run single-threaded unless told otherwise, because the machines
this runs on are shared.

Over 600 lines as one concept: training predictor parameters from a trace's train split. The
trainers share the validation cut, the recall measure and the torch set-up; each predictor's
trainer is one section (cooc, trajectory / learned, pregate).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

import numpy as np

from ..progress import bar
from ..progress import write as progress_write
from .sidecar import Sidecar
from .traces import RoutingTrace

# ------------------------------------------------------------------------------------------------
# Shared helpers
# ------------------------------------------------------------------------------------------------


def _invalid(message: str) -> Exception:
    from sharpi._core import InvalidArgument

    return InvalidArgument(message)


def _log(message: str, quiet: bool) -> None:
    if not quiet:
        progress_write(message)  # above an epoch bar being drawn


def _epochs(epochs, what: str, quiet: bool):
    """The epochs (a range) under a bar on stderr (sharpi.progress: a terminal only, never when quiet)."""
    return bar(epochs, desc=what, unit="epoch", disable=quiet)


def validation_cut(
    trace: RoutingTrace, train_idx: np.ndarray, fraction: float
) -> tuple[np.ndarray, np.ndarray]:
    """Splits the train tokens by sequence: the last `fraction` of the train sequences validate.
    With a single train sequence it falls back to the last `fraction` of its tokens."""
    starts = np.intersect1d(trace.seq_start, train_idx)
    if len(starts) >= 2:
        n_fit = min(max(round(len(starts) * (1 - fraction)), 1), len(starts) - 1)
        cut = starts[n_fit]
    else:
        cut = train_idx[int(len(train_idx) * (1 - fraction))]
    return train_idx[train_idx < cut], train_idx[train_idx >= cut]


def validation_rows(
    trace: RoutingTrace, train_idx: np.ndarray, fraction: float, max_tokens: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """validation_cut, then at most `max_tokens` of the validation tokens (drawn with `rng`, in order)."""
    fit_idx, val_idx = validation_cut(trace, np.asarray(train_idx, dtype=np.int64), fraction)
    if len(val_idx) > max_tokens:
        val_idx = np.sort(rng.choice(val_idx, size=max_tokens, replace=False))
    return fit_idx, val_idx


def fit_best_epoch(
    n_rows: int,
    batch: int,
    epochs: int,
    rng: np.random.Generator,
    step: Callable[[np.ndarray], None],
    val_recall: Callable[[], float],
    snapshot: Callable[[], object],
    name: str,
    quiet: bool,
) -> tuple[float, object, int]:
    """The loop of the convex table fits (cooc's refinement, the history regression): each epoch
    visits the n_rows fit rows once, in an order drawn from `rng`, calling step(rows) on each batch of
    `batch` row numbers (the optimiser's update). After each epoch val_recall() is measured; the
    best parameters, starting with the unfitted ones (epoch 0), are kept by snapshot(). Returns
    (recall, snapshot, epoch) of the best."""
    t0 = time.perf_counter()
    best = (val_recall(), snapshot(), 0)
    for epoch in _epochs(range(1, epochs + 1), name, quiet):
        order = rng.permutation(n_rows)
        for b0 in range(0, n_rows, batch):
            step(order[b0 : b0 + batch])
        r = val_recall()
        _log(f"{name}: epoch {epoch} validation recall@k {r:.4f} ({time.perf_counter() - t0:.0f} s)", quiet)
        if r > best[0]:
            best = (r, snapshot(), epoch)
    _log(f"{name}: kept epoch {best[2]} (validation recall@k {best[0]:.4f})", quiet)
    return best


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

        def ratio(src: np.ndarray, dst: np.ndarray, p: np.ndarray = p) -> np.ndarray:
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
    refine_history: int = 6,
    refine_epochs: int = 8,
    seed: int = 0,
    source: str = "",
    quiet: bool = False,
) -> Sidecar:
    """Co-occurrence predictor, in numpy.

    Counts first: the history m and one weight per term (bias, each layer offset o, previous token)
    are tuned by coordinate ascent on mean recall@k over d = 1..max_lookahead, on a validation slice
    carved from the last `val_fraction` of the TRAIN sequences (tables fitted on the rest).

    Then, with refine_epochs > 0, the same tables over a longer history (refine_history layers) are
    fitted discriminatively (_refine_cooc: softmax regression on the table entries, which is convex)
    and kept only if they beat the count tables on the same validation slice. The result has the
    cooc format either way: a score is still a sum of table rows picked by the co-occurring experts."""
    if not 1 <= max_lookahead <= 3:
        raise _invalid(f"max_lookahead {max_lookahead} outside 1..3")
    t0 = time.perf_counter()
    E, k, n_layer = trace.n_expert, trace.top_k, trace.n_layer
    fit_idx, val_idx = validation_rows(trace, train_idx, val_fraction, val_tokens, np.random.default_rng(seed))
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
        w[2 + max_lookahead + m - 1 :] = 0.0  # offsets this m never uses
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
        _log(
            f"cooc: history m={m}: validation recall@k {score:.4f} weights bias {w[0]:g} prev {w[1]:g} "
            f"offsets {w[2 : 2 + max_lookahead + m - 1].tolist()}",
            quiet,
        )
        if score > best[0]:
            best = (score, m, w)
    score, m, w = best
    n_off = max_lookahead + m - 1
    bias, layer_tab, prev_tab = _cooc_tables(trace, np.asarray(train_idx, dtype=np.int64), n_off, smoothing)
    tensors = {
        "cooc.bias": (w[0] * bias).astype(np.float32),
        "cooc.layer": (layer_tab * w[2 : 2 + n_off][None, :, None, None]).astype(np.float32),
        "cooc.prev": (w[1] * prev_tab).astype(np.float32),
    }
    fit = "counts"
    if refine_epochs > 0:
        m_ref = max(refine_history, m)
        refined, ref_score = _refine_cooc(trace, fit_idx, val_idx, max_lookahead, m_ref, refine_epochs, seed, quiet)
        _log(f"cooc: refined tables (history {m_ref}) validation recall@k {ref_score:.4f} vs counts {score:.4f}", quiet)
        if ref_score > score:
            tensors, m, score, fit = refined, m_ref, ref_score, "softmax regression"
    _log(
        f"cooc: chose history {m}, {fit} (validation recall@k {score:.4f} on {Nv} tokens); "
        f"trained in {time.perf_counter() - t0:.1f} s",
        quiet,
    )
    return Sidecar(
        "cooc",
        n_layer,
        E,
        k,
        max_lookahead,
        source or f"{trace.path}: {len(train_idx)} train tokens",
        {"cooc.history": m},
        tensors,
    )


def _refine_cooc(
    trace: RoutingTrace,
    fit_idx: np.ndarray,
    val_idx: np.ndarray,
    max_lookahead: int,
    m: int,
    epochs: int,
    seed: int,
    quiet: bool,
    batch: int = 2048,
    lr: float = 0.02,
) -> tuple[dict, float]:
    """Fits the cooc tables as one softmax regression per target layer t, shared by every distance
    d: scores_{t,d} = bias[t] + sum_{o=d}^{d+m-1} hot(S(t-o)) @ layer[t, o-1] + hot(P(t)) @ prev[t],
    trained with Adam on the cross-entropy against the selected set (each selected expert 1/|S|),
    on fit_idx only. The loss is convex in the tables; the epoch with the best mean recall@k on
    val_idx is kept. Returns (cooc tensors, that recall)."""
    E, k, n_layer = trace.n_expert, trace.top_k, trace.n_layer
    n_off = max_lookahead + m - 1
    rng = np.random.default_rng(seed)

    def hots(idx):
        prev = trace.prev_index()[idx]
        cur = np.stack([trace.multi_hot(idx, t, dtype=np.float32) for t in range(n_layer)])
        prv = np.stack([trace.multi_hot(prev, t, dtype=np.float32) for t in range(n_layer)])
        return cur, prv

    f_cur, f_prev = hots(fit_idx)
    v_cur, v_prev = hots(val_idx)
    params = {
        "bias": np.log((f_cur.sum(axis=1) + 1.0) / (len(fit_idx) + E)).astype(np.float32),
        "layer": np.zeros((n_layer, n_off, E, E), dtype=np.float32),
        "prev": np.zeros((n_layer, E, E), dtype=np.float32),
    }
    moments = {name: (np.zeros_like(v), np.zeros_like(v)) for name, v in params.items()}

    def scores(cur, prv, rows, t, d):
        s = params["bias"][t] + prv[t][rows] @ params["prev"][t]
        for o in range(d, d + m):
            if t - o >= 0:
                s = s + cur[t - o][rows] @ params["layer"][t, o - 1]
        return s

    def val_recall() -> float:
        rows = np.arange(len(val_idx))
        total = 0.0
        for d in range(1, max_lookahead + 1):
            total += np.mean([_recall(scores(v_cur, v_prev, rows, t, d), v_cur[t], k) for t in range(d, n_layer)])
        return total / max_lookahead

    n_steps = 0

    def adam_step(rows: np.ndarray) -> None:
        nonlocal n_steps
        grads = {name: np.zeros_like(v) for name, v in params.items()}
        for t in range(1, n_layer):
            target = f_cur[t][rows]
            n_sel = target.sum(axis=1, keepdims=True)
            target = np.divide(target, n_sel, out=np.zeros_like(target), where=n_sel > 0)
            valid = (n_sel > 0).astype(np.float32)
            for d in range(1, min(max_lookahead, t) + 1):
                s = scores(f_cur, f_prev, rows, t, d)
                s -= s.max(axis=1, keepdims=True)
                p = np.exp(s)
                p /= p.sum(axis=1, keepdims=True)
                g = (p - target) * valid / len(rows)
                grads["bias"][t] += g.sum(axis=0)
                grads["prev"][t] += f_prev[t][rows].T @ g
                for o in range(d, d + m):
                    if t - o >= 0:
                        grads["layer"][t, o - 1] += f_cur[t - o][rows].T @ g
        n_steps += 1
        for name, v in params.items():  # Adam
            m1, m2 = moments[name]
            m1 *= 0.9
            m1 += 0.1 * grads[name]
            m2 *= 0.999
            m2 += 0.001 * grads[name] ** 2
            v -= lr * (m1 / (1 - 0.9**n_steps)) / (np.sqrt(m2 / (1 - 0.999**n_steps)) + 1e-8)

    best = fit_best_epoch(
        len(fit_idx),
        batch,
        epochs,
        rng,
        adam_step,
        val_recall,
        lambda: {name: v.copy() for name, v in params.items()},
        "cooc refine",
        quiet,
    )
    tensors = {f"cooc.{name}": v.astype(np.float32) for name, v in best[1].items()}
    return tensors, best[0]


# ------------------------------------------------------------------------------------------------
# trajectory: tiny transformer over the routing history (torch)
# ------------------------------------------------------------------------------------------------


def make_trajectory_module(
    torch,
    n_layer: int,
    n_expert: int,
    d_model: int = 128,
    n_block: int = 2,
    n_head: int = 4,
    d_ff: int = 256,
    max_lookahead: int = 3,
    window: int = 10,
):
    """The torch twin of reference.TrajectoryPredictor; parameter names map 1:1 onto the sidecar
    tensors (`sidecar_tensors`). Built inside a function so torch stays an optional import."""
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(d_model, eps=1e-5)
            self.qkv = nn.Linear(d_model, 3 * d_model)
            self.out = nn.Linear(d_model, d_model)
            self.ln2 = nn.LayerNorm(d_model, eps=1e-5)
            self.up = nn.Linear(d_model, d_ff)
            self.down = nn.Linear(d_ff, d_model)

        def forward(self, x):
            B, n, D = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
            # head h = columns [h*D/H, (h+1)*D/H) of q, k and v (same split as the reference)
            q, k, v = (z.reshape(B, n, n_head, D // n_head).transpose(1, 2) for z in (q, k, v))
            ctx = F.scaled_dot_product_attention(q, k, v)  # no mask: every position sees every other
            x = x + self.out(ctx.transpose(1, 2).reshape(B, n, D))
            return x + self.down(F.gelu(self.up(self.ln2(x))))  # exact (erf) GELU

    class TrajectoryNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.n_layer, self.n_expert, self.max_lookahead, self.window = (
                n_layer,
                n_expert,
                max_lookahead,
                window,
            )
            self.hparams = {
                "trajectory.window": window,
                "trajectory.d_model": d_model,
                "trajectory.n_block": n_block,
                "trajectory.n_head": n_head,
                "trajectory.d_ff": d_ff,
            }
            self.expert_emb = nn.Parameter(torch.randn(n_layer, n_expert, d_model) * 0.1)
            self.layer_emb = nn.Parameter(torch.randn(n_layer, d_model) * 0.1)
            self.prev_emb = nn.Parameter(torch.randn(n_layer, n_expert, d_model) * 0.1)
            self.prev_none = nn.Parameter(torch.randn(d_model) * 0.1)
            self.blocks = nn.ModuleList(Block() for _ in range(n_block))
            self.ln_f = nn.LayerNorm(d_model, eps=1e-5)
            self.head_w = nn.Parameter(torch.randn(max_lookahead, n_layer, n_expert, d_model) * d_model**-0.5)
            self.head_b = nn.Parameter(torch.zeros(max_lookahead, n_layer, n_expert))

        def _bag(self, table, layers, ids):
            """sum over the k ids of table[layer, id]; ids [B, m, k] (-1 = none), layers [m] -> [B, m, D]"""
            emb = table[layers[None, :, None], ids.clamp(min=0)]
            return (emb * (ids >= 0).unsqueeze(-1).to(emb.dtype)).sum(dim=2)

        def forward(self, cur_ids, prev_ids, has_prev, L: int):
            """cur_ids / prev_ids long [B, n_layer, k] (-1 = missing), has_prev bool [B], source layer L
            -> scores [max_lookahead, B, E] for layers L+1..L+max_lookahead (slices past the last layer
            are meaningless: the caller ignores them)."""
            n = min(self.window, L + 1) + 1
            dev = cur_ids.device
            src = torch.arange(L - n + 2, L + 1, device=dev)
            x_hist = self.layer_emb[src] + self._bag(self.expert_emb, src, cur_ids[:, src])
            targets = torch.arange(L + 1, min(L + self.max_lookahead, self.n_layer - 1) + 1, device=dev)
            last = self._bag(self.prev_emb, targets, prev_ids[:, targets]).sum(dim=1)
            last = torch.where(has_prev[:, None], last, self.prev_none.expand_as(last))
            x = torch.cat([x_hist, last[:, None]], dim=1)
            for blk in self.blocks:
                x = blk(x)
            y = self.ln_f(x[:, n - 2])
            t = torch.clamp(torch.arange(L + 1, L + self.max_lookahead + 1, device=dev), max=self.n_layer - 1)
            w = self.head_w[torch.arange(self.max_lookahead, device=dev), t]  # [dmax, E, D]
            b = self.head_b[torch.arange(self.max_lookahead, device=dev), t]  # [dmax, E]
            return torch.einsum("bd,ted->tbe", y, w) + b[:, None, :]

        def sidecar_tensors(self) -> dict[str, np.ndarray]:
            def f32(p):
                return p.detach().cpu().to(torch.float32).numpy().copy()

            out = {
                "traj.expert_emb": f32(self.expert_emb),
                "traj.layer_emb": f32(self.layer_emb),
                "traj.prev_emb": f32(self.prev_emb),
                "traj.prev_none": f32(self.prev_none),
            }
            for i, blk in enumerate(self.blocks):
                pre = f"traj.blk.{i}."
                for name, mod in (
                    ("ln1", blk.ln1),
                    ("qkv", blk.qkv),
                    ("out", blk.out),
                    ("ln2", blk.ln2),
                    ("up", blk.up),
                    ("down", blk.down),
                ):
                    out[pre + name + ".w"] = f32(mod.weight)
                    out[pre + name + ".b"] = f32(mod.bias)
            out["traj.ln_f.w"], out["traj.ln_f.b"] = f32(self.ln_f.weight), f32(self.ln_f.bias)
            for d in range(1, self.max_lookahead + 1):
                out[f"traj.head.{d}.w"] = f32(self.head_w[d - 1])
                out[f"traj.head.{d}.b"] = f32(self.head_b[d - 1])
            return out

    return TrajectoryNet()


def _soft_target_loss(torch, scores, target_ids, n_expert: int):
    """Softmax cross-entropy against the selected set as a uniform target distribution.
    scores [B, E], target_ids long [B, k] (-1 = missing); rows with no known id are ignored."""
    known = target_ids >= 0
    target = torch.zeros_like(scores)
    target.scatter_add_(1, target_ids.clamp(min=0), known.to(scores.dtype))
    n_known = target.sum(dim=1)
    ok = n_known > 0
    target = target[ok] / n_known[ok, None]
    return -(target * torch.log_softmax(scores[ok], dim=1)).sum(dim=1).mean()


def _epoch_batches(rng: np.random.Generator, idx: np.ndarray, n_source: int, batch: int):
    """One epoch: every token once, each with a random source layer; batches share a source layer
    (a batch is one sequence length, so no padding and no mask are needed)."""
    layers = rng.integers(0, n_source, size=len(idx))
    out = []
    for L in range(n_source):
        tok = rng.permutation(idx[layers == L])
        out += [(L, tok[i : i + batch]) for i in range(0, len(tok), batch)]
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def _trajectory_val_recall(torch, net, experts_t, prev_t, val_idx, n_layer, k) -> float:
    net.eval()
    hits = total = 0.0
    with torch.no_grad():
        vi = torch.from_numpy(val_idx)
        cur, pv = experts_t[vi], prev_t[vi]
        prev_ids = experts_t[pv.clamp(min=0)]
        for L in range(n_layer - 1):
            s = net(cur, prev_ids, pv >= 0, L)
            for d in range(1, net.max_lookahead + 1):
                if L + d < n_layer:
                    top = s[d - 1].topk(k, dim=1).indices
                    sel = cur[:, L + d]
                    hit = (top[:, :, None] == sel[:, None, :]).any(dim=1).sum(dim=1).to(torch.float64)
                    n_sel = (sel >= 0).sum(dim=1)
                    ok = n_sel > 0
                    hits += float((hit[ok] / n_sel[ok]).sum())
                    total += float(ok.sum())
    net.train()
    return hits / max(total, 1.0)


def train_trajectory(
    trace: RoutingTrace,
    train_idx: np.ndarray,
    max_lookahead: int = 3,
    window: int = 10,
    d_model: int = 128,
    n_block: int = 2,
    n_head: int = 4,
    d_ff: int = 256,
    epochs: int = 14,
    batch: int = 256,
    lr: float = 2e-3,
    weight_decay: float = 0.01,
    val_fraction: float = 0.1,
    val_tokens: int = 2000,
    time_budget_s: float = 540.0,
    seed: int = 0,
    num_threads: int | None = 1,
    source: str = "",
    quiet: bool = False,
) -> Sidecar:
    """Trains the trajectory transformer with AdamW on softmax cross-entropy (selected set as a
    uniform target), one random source layer per token per epoch, linear learning-rate decay. A
    validation slice from the last `val_fraction` of the TRAIN sequences picks the best epoch. Stops
    early (keeping the best weights so far) once `time_budget_s` is spent, so a run stays inside the
    10-minute budget on one core."""
    torch = _torch(num_threads)
    if not 1 <= max_lookahead <= 3 or not 1 <= window <= 10:
        raise _invalid(f"max_lookahead {max_lookahead} must be 1..3 and window {window} 1..10")
    if d_model % n_head:
        raise _invalid(f"d_model {d_model} must be divisible by n_head {n_head}")
    if trace.n_layer < 2:
        raise _invalid(f"trace {trace.path}: a trajectory predictor needs at least 2 MoE layers")
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    n_layer, E, k = trace.n_layer, trace.n_expert, trace.top_k
    fit_idx, val_idx = validation_rows(trace, train_idx, val_fraction, val_tokens, rng)
    net = make_trajectory_module(torch, n_layer, E, d_model, n_block, n_head, d_ff, max_lookahead, window)
    experts_t = torch.from_numpy(trace.experts.astype(np.int64))
    prev_t = torch.from_numpy(trace.prev_index())
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
    n_steps = epochs * math.ceil(len(fit_idx) / batch) + n_layer  # + slack for the per-layer remainders
    # Linear decay over whichever runs out first, the steps or the time budget, so a run the budget
    # cuts short still ends at a low learning rate.
    step = 0
    best = (-1.0, None, 0)
    out_of_time = False
    for epoch in _epochs(range(1, epochs + 1), "trajectory", quiet):
        t_epoch, total, n_batch = time.perf_counter(), 0.0, 0
        for L, tok in _epoch_batches(rng, fit_idx, n_layer - 1, batch):
            ti = torch.from_numpy(tok)
            pv = prev_t[ti]
            cur = experts_t[ti]
            scores = net(cur, experts_t[pv.clamp(min=0)], pv >= 0, L)
            loss = sum(
                _soft_target_loss(torch, scores[d - 1], cur[:, L + d], E)
                for d in range(1, max_lookahead + 1)
                if L + d < n_layer
            )
            progress = max(step / n_steps, (time.perf_counter() - t0) / time_budget_s)
            for group in opt.param_groups:
                group["lr"] = lr * max(0.05, 1.0 - progress)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            total += float(loss.detach())
            n_batch += 1
            if time.perf_counter() - t0 > time_budget_s:
                out_of_time = True
                break
        val = _trajectory_val_recall(torch, net, experts_t, prev_t, val_idx, n_layer, k)
        _log(
            f"trajectory: epoch {epoch} loss {total / max(n_batch, 1):.4f} validation recall@k {val:.4f} "
            f"({time.perf_counter() - t_epoch:.0f} s)" + (" [time budget reached]" if out_of_time else ""),
            quiet,
        )
        if val > best[0]:
            best = (val, {n: p.detach().clone() for n, p in net.state_dict().items()}, epoch)
        if out_of_time:
            break
    net.load_state_dict(best[1])
    elapsed = time.perf_counter() - t0
    _log(
        f"trajectory: kept epoch {best[2]} (validation recall@k {best[0]:.4f}); trained in {elapsed:.1f} s "
        f"on {torch.get_num_threads()} thread(s)",
        quiet,
    )
    return Sidecar(
        "trajectory",
        n_layer,
        E,
        k,
        max_lookahead,
        source or f"{trace.path}: {len(train_idx)} train tokens",
        dict(net.hparams),
        net.sidecar_tensors(),
    )


# ------------------------------------------------------------------------------------------------
# learned: per-layer MLP over the hidden state (torch)
# ------------------------------------------------------------------------------------------------


def train_learned(
    trace: RoutingTrace,
    train_idx: np.ndarray,
    max_lookahead: int = 3,
    hidden: int = 64,
    rank: int = 32,
    epochs: int = 60,
    batch: int = 128,
    lr: float = 3e-3,
    weight_decay: float = 0.05,
    seed: int = 0,
    num_threads: int | None = 1,
    source: str = "",
    quiet: bool = False,
) -> Sidecar:
    """One MLP per source layer L = 0..n_layer-2 over x = hidden_L / rms(hidden_L), optionally
    PCA-compressed to `rank` dimensions (0 = none; capped at n_embd and at the train token count);
    softmax cross-entropy per target layer L+d. Needs a trace with hidden states."""
    torch = _torch(num_threads)
    from .reference import LEARNED_RMS_EPS, rms_norm

    if trace.hidden is None:
        raise _invalid(
            f"trace {trace.path}: the learned predictor trains on hidden states; this trace has none"
        )
    if not 1 <= max_lookahead <= 3:
        raise _invalid(f"max_lookahead {max_lookahead} outside 1..3")
    if trace.n_layer < 2:
        raise _invalid(f"trace {trace.path}: the learned predictor needs at least 2 MoE layers")
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    idx = np.asarray(train_idx, dtype=np.int64)
    n_layer, E, k, n_embd = trace.n_layer, trace.n_expert, trace.top_k, trace.n_embd
    rank = max(0, min(rank, n_embd, len(idx)))
    tensors: dict[str, np.ndarray] = {}
    for L in bar(range(n_layer - 1), desc=f"learned: {epochs} epochs per layer", unit="layer", disable=quiet):
        x = rms_norm(trace.hidden_rows(idx, L), LEARNED_RMS_EPS)
        if rank > 0:
            mean = x.mean(axis=0)
            # principal directions: right singular vectors of the centred data, largest first
            _, _, vt = np.linalg.svd(x - mean, full_matrices=False)
            pca = vt[:rank]
            z = (x - mean) @ pca.T
            tensors[f"learned.{L}.pca_mean"] = mean.astype(np.float32)
            tensors[f"learned.{L}.pca"] = pca.astype(np.float32)
        else:
            z = x
        w1 = torch.nn.Linear(z.shape[1], hidden)
        w2 = torch.nn.Linear(hidden, max_lookahead * E)
        params = list(w1.parameters()) + list(w2.parameters())
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        zt = torch.from_numpy(z.astype(np.float32))
        targets = {
            d: torch.from_numpy(trace.selected(idx, L + d))
            for d in range(1, max_lookahead + 1)
            if L + d < n_layer
        }
        for _ in range(epochs):
            for b0 in range(0, len(idx), batch):
                rows = (
                    torch.from_numpy(rng.permutation(len(idx))[:batch]) if len(idx) > batch else slice(None)
                )
                s = w2(torch.relu(w1(zt[rows])))
                loss = sum(
                    _soft_target_loss(torch, s[:, (d - 1) * E : d * E], tgt[rows], E)
                    for d, tgt in targets.items()
                )
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        for name, mod in (("w1", w1), ("w2", w2)):
            tensors[f"learned.{L}.{name}"] = mod.weight.detach().numpy().astype(np.float32)
            tensors[f"learned.{L}.b{name[1]}"] = mod.bias.detach().numpy().astype(np.float32)
        _log(f"learned: source layer {L}: final train loss {float(loss.detach()):.4f}", quiet)
    _log(f"learned: trained {n_layer - 1} layers in {time.perf_counter() - t0:.1f} s", quiet)
    return Sidecar(
        "learned",
        n_layer,
        E,
        k,
        max_lookahead,
        source or f"{trace.path}: {len(idx)} train tokens",
        {"n_embd": n_embd, "learned.hidden": hidden, "learned.rank": rank},
        tensors,
    )


# ------------------------------------------------------------------------------------------------
# pregate: least-squares pre-gate weights, written into a copy of the model
# ------------------------------------------------------------------------------------------------


def fit_pregate(trace: RoutingTrace, train_idx: np.ndarray, routers, ridge: float = 1e-4):
    """Least squares (with a small ridge, relative to the mean feature energy) from
    ffn_norm_N(hidden_N) to layer N+1's router logits, for N = 0..n_layer-2.
    Targets: the trace's router_logits when present, else layer N+1's router applied to hidden_{N+1}.
    Returns ([numpy [n_expert, n_embd] per N], overall R^2 on the train tokens)."""
    idx = np.asarray(train_idx, dtype=np.int64)
    weights, ss_res, ss_tot = [], 0.0, 0.0
    for N in range(trace.n_layer - 1):
        x = routers.normed(trace.hidden_rows(idx, N), N)
        if trace.router_logits is not None:
            y = trace.router_logits[idx, N + 1].astype(np.float64)
        else:
            y = routers.router_logits(trace.hidden_rows(idx, N + 1), N + 1)
        gram = x.T @ x
        lam = ridge * np.trace(gram) / gram.shape[0]
        w = np.linalg.solve(gram + lam * np.eye(gram.shape[0]), x.T @ y)  # [n_embd, E]
        ss_res += float(((x @ w - y) ** 2).sum())
        ss_tot += float(((y - y.mean(axis=0)) ** 2).sum())
        weights.append(w.T.copy())
    return weights, 1.0 - ss_res / max(ss_tot, 1e-300)


def copy_model_with_tensors(model_path: str, out_path: str, extra: dict[str, np.ndarray]) -> None:
    """Writes a copy of the GGUF `model_path` to `out_path` with the f32 tensors `extra` added
    (replacing same-named ones). Every other tensor is copied as raw bytes with its ggml type and
    shape, every metadata key with its type, in the original order; the data alignment is kept."""
    import gguf

    if os.path.abspath(model_path) == os.path.abspath(out_path):
        raise _invalid(
            f"pregate output {out_path} must differ from the model file (the model is never modified)"
        )
    reader = gguf.GGUFReader(model_path)
    arch = str(reader.fields["general.architecture"].contents())
    tmp = out_path + ".tmp"
    writer = gguf.GGUFWriter(tmp, arch, endianess=reader.endianess)
    align = reader.fields.get("general.alignment")
    if align is not None:
        writer.data_alignment = int(align.contents())
    for f in reader.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF."):
            continue  # the writer writes these itself
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), vtype, sub_type=sub)
    kept = [t for t in reader.tensors if t.name not in extra]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    extra = {n: np.ascontiguousarray(a, dtype=np.float32) for n, a in extra.items()}
    for n, a in extra.items():
        writer.add_tensor_info(n, a.shape, a.dtype, a.nbytes, gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    for a in extra.values():
        writer.write_tensor_data(a)
    writer.close()
    os.replace(tmp, out_path)


def train_pregate(
    trace: RoutingTrace,
    train_idx: np.ndarray,
    model_path: str,
    out_path: str,
    ridge: float = 1e-4,
    quiet: bool = False,
) -> dict:
    """Fits pre-gate weights on the train tokens and writes a copy of the model with
    `blk.N.ffn_pregate_inp.weight` (f32, numpy [n_expert, n_embd]) for the blocks of MoE layers
    0..n_layer-2. Returns {"n_tensors", "r2", "names"}."""
    from .reference import ModelRouters

    if trace.hidden is None:
        raise _invalid(f"trace {trace.path}: pregate training needs hidden states; this trace has none")
    routers = ModelRouters(model_path, trace.moe_layer_ids)
    routers.check_trace("pregate", trace)
    t0 = time.perf_counter()
    weights, r2 = fit_pregate(trace, train_idx, routers, ridge)
    extra = {f"blk.{routers.layer_blocks[N]}.ffn_pregate_inp.weight": w for N, w in enumerate(weights)}
    copy_model_with_tensors(model_path, out_path, extra)
    _log(f"pregate: {len(extra)} tensors, train R^2 {r2:.4f}, {time.perf_counter() - t0:.1f} s", quiet)
    return {"n_tensors": len(extra), "r2": r2, "names": list(extra)}
