"""Float64 numpy reference inference of every built-in predictor (docs/predictors.md).

What it owns: the predictor math, written once, plainly, vectorised over tokens, as the oracle the
C++ engine's predictors and the torch training modules are tested against. It reads sidecars through
sidecar.read_sidecar and model routers through `ModelRouters` (gguf.GGUFReader + dequantize); it never
writes anything and never keeps a file open.

Interface: every predictor has `name`, `n_expert`, `max_lookahead` and
    scores_all(trace, idx, L) -> float64 [max_lookahead, len(idx), n_expert]
whose slice d-1 scores target layer L+d for the tokens idx (global indices of `trace`); a row of
-inf means "no prediction" (e.g. prev_token on a sequence's first token, or L+d past the last layer),
and -inf entries are never predicted. `scores(trace, idx, L, d)` is the one-slice form.
`predicted_sets(scores, k)` turns scores into the predicted sets: the top-k finite scores, ties
broken by the lower expert id, -1 padding where fewer than k are finite.
"""

from __future__ import annotations

import math
import os

import numpy as np

from .sidecar import (
    DEPTHTIME_BASE_FEATURES,
    DEPTHTIME_DECAYS,
    DEPTHTIME_FEATURES,
    DEPTHTIME_POOL_POWERS,
    DEPTHTIME_PRODUCTS,
    DEPTHTIME_VOTE_POWERS,
    DEPTHTIME_VOTE_WINDOW,
    Sidecar,
    depthtime_features,
    depthtime_gate,
    depthtime_pool,
    read_sidecar,
)
from .traces import RoutingTrace, ids_to_multi_hot

NO_PREDICTION = -np.inf
LAYER_NORM_EPS = 1e-5  # trajectory LayerNorms (spec)
LEARNED_RMS_EPS = 1e-6  # learned predictor input normalisation (spec)


def _invalid(message: str) -> Exception:
    from sharpi._core import InvalidArgument

    return InvalidArgument(message)


def predicted_sets(scores: np.ndarray, k: int) -> np.ndarray:
    """scores [N, E] -> int64 [N, k]: best first, ties to the lower id, -1 where the score is -inf."""
    # A stable sort of -scores keeps equal scores in id order: the lower id wins a tie.
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    top = np.take_along_axis(scores, order, axis=1)
    order[~np.isfinite(top) & (top < 0)] = -1
    return order.astype(np.int64)


def erf(x: np.ndarray) -> np.ndarray:
    try:
        from scipy.special import erf as scipy_erf

        return scipy_erf(x)
    except ImportError:  # scipy is not a dependency; math.erf is exact, only slower
        return np.frompyfunc(math.erf, 1, 1)(x).astype(np.float64)


def gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float = LAYER_NORM_EPS) -> np.ndarray:
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """x [..., in] @ w[out, in]^T + b as one 2-D GEMM (a stacked 3-D matmul runs one tiny GEMM per
    leading index, ~50x slower here)."""
    return (x.reshape(-1, x.shape[-1]) @ w.T + b).reshape(*x.shape[:-1], w.shape[0])


def rms_norm(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


class ReferencePredictor:
    name = "base"
    n_expert: int
    max_lookahead: int

    def check_trace(self, trace: RoutingTrace) -> None:
        """Raises InvalidArgument when this predictor cannot score `trace` (shape mismatch, missing
        hidden states)."""

    def scores_all(self, trace: RoutingTrace, idx: np.ndarray, L: int) -> np.ndarray:
        raise NotImplementedError

    def scores(self, trace: RoutingTrace, idx: np.ndarray, L: int, d: int) -> np.ndarray:
        if not 1 <= d <= self.max_lookahead:
            raise _invalid(f"predictor {self.name}: lookahead {d} outside 1..{self.max_lookahead}")
        return self.scores_all(trace, idx, L)[d - 1]

    def _empty(self, n_tokens: int) -> np.ndarray:
        return np.full((self.max_lookahead, n_tokens, self.n_expert), NO_PREDICTION)


def _check_shape(name: str, trace: RoutingTrace, n_layer: int, n_expert: int, top_k: int | None) -> None:
    if (trace.n_layer, trace.n_expert) != (n_layer, n_expert) or (top_k is not None and trace.top_k != top_k):
        raise _invalid(
            f"predictor {name} is for n_layer={n_layer}, n_expert={n_expert}, top_k={top_k}; trace "
            f"{trace.path} has n_layer={trace.n_layer}, n_expert={trace.n_expert}, top_k={trace.top_k}"
        )


# ------------------------------------------------------------------------------------------------
# History-only predictors
# ------------------------------------------------------------------------------------------------


class PrevTokenPredictor(ReferencePredictor):
    """Layer L+d: the previous token's experts at L+d (no prediction for a sequence's first token)."""

    name = "prev_token"

    def __init__(self, n_expert: int, max_lookahead: int = 3):
        self.n_expert, self.max_lookahead = n_expert, max_lookahead

    def check_trace(self, trace):
        _check_shape(self.name, trace, trace.n_layer, self.n_expert, None)

    def scores_all(self, trace, idx, L):
        out = self._empty(len(idx))
        prev = trace.prev_index()[idx]
        for d in range(1, self.max_lookahead + 1):
            if L + d < trace.n_layer:
                hot = trace.multi_hot(prev, L + d) > 0
                out[d - 1][hot] = 1.0
        return out


class CoocPredictor(ReferencePredictor):
    """score_t = bias[t] + sum_{o=d}^{d+m-1, t-o>=0} sum_{i in S(t-o)} layer[t, o-1, i]
    + sum_{i in P(t)} prev[t, i]"""

    name = "cooc"

    def __init__(self, sc: Sidecar):
        self.sc = sc
        self.n_layer, self.n_expert, self.top_k = sc.n_layer, sc.n_expert, sc.top_k
        self.max_lookahead, self.history = sc.max_lookahead, sc.params["cooc.history"]
        self.bias = sc.tensors["cooc.bias"].astype(np.float64)
        self.layer = sc.tensors["cooc.layer"].astype(np.float64)
        self.prev = sc.tensors["cooc.prev"].astype(np.float64)

    def check_trace(self, trace):
        _check_shape(self.name, trace, self.n_layer, self.n_expert, self.top_k)

    def scores_all(self, trace, idx, L):
        out = self._empty(len(idx))
        prev_hot_cache: dict[int, np.ndarray] = {}
        prev = trace.prev_index()[idx]
        for d in range(1, self.max_lookahead + 1):
            t = L + d
            if t >= self.n_layer:
                continue
            s = np.broadcast_to(self.bias[t], (len(idx), self.n_expert)).copy()
            for o in range(d, d + self.history):
                if t - o >= 0:
                    s += trace.multi_hot(idx, t - o) @ self.layer[t, o - 1]
            if t not in prev_hot_cache:
                prev_hot_cache[t] = trace.multi_hot(prev, t)
            s += prev_hot_cache[t] @ self.prev[t]
            out[d - 1] = s
        return out


class DepthTimePredictor(ReferencePredictor):
    """score_{t,d} = sum_f stack[d-1, t, f] * feature_f over the per-expert features
    sidecar.depthtime_features(sc) (docs/predictors.md, "depthtime"). L = t - d is the source layer, S(l)
    the current token's selected set at layer l, S_{-j}(l) that of the token j steps back in the same
    sequence (P = S_{-1}), n the number of earlier tokens of the sequence, W = DEPTHTIME_VOTE_WINDOW:

      reg      bias[t] + sum_{l<=L} sum_{i in S(l)} layer[t, t-l-1, i]
                       + sum_{r=-1..1, 0<=t+r<n_layer} sum_{i in P(t+r)} prev[t, r+1, i]
      cnt      count_bias[t] + sum_{i in S(L)} count[t, d-1, i]
      prev<j>  [e in S_{-j}(t)]                                     j = 1..4 (0 past the start)
      hist<λ>  sum_{j=1..n} λ^(j-1) [e in S_{-j}(t)]                 λ in DEPTHTIME_DECAYS
      freq     (1/n) sum_{j=1..n} [e in S_{-j}(t)]                   (0 when n = 0)
      vote<p>  sum_{j=1..min(n, W)} m_j^p [e in S_{-j}(t)]           p in DEPTHTIME_VOTE_POWERS
      nvote<p> vote<p> / max(sum_{j=1..min(n, W)} m_j^p, 1e-6)
      with m_j = sum_{l<=L} |S(l) ∩ S_{-j}(l)| / (top_k (L + 1))

    then the products DEPTHTIME_PRODUCTS of two of those, with regp = softmax of reg over the experts:
      reg * {vote, nvote}<p>, regp * {vote, nvote}<p>, reg * prev1, reg * hist0.9, reg * freq, cnt * nvote4
    and, when the sidecar has depthtime.pool = N > 0 (dt.pool: the routes Q_i(l) of N training tokens,
    -1 = unknown), the pool votes and their products:
      pvote<p> sum_{i in Nb} r_i^p #{slots of Q_i(t) = e} / sum_{i in Nb} r_i^p     p in DEPTHTIME_POOL_POWERS
      with c_i = sum_{l<=L} #{slots of Q_i(l) in S(l)}, Nb the min(M, N) pool tokens of largest c_i
      (ties: the lower i; M = depthtime.neighbours), r_i = c_i / max_i c_i (all votes 0 when that is 0)
      reg * pvote<p>, regp * pvote<p>
    and, when the sidecar has depthtime.gate = 1, last (`routers` needed):
      gate     router_t · (rms_norm(hidden_L) * ffn_norm_t)    (next_gate's score)
      gatep    softmax of gate over the experts

    The votes are a retrieval: earlier tokens of the sequence whose route so far matches the current
    token's vote for what they chose at t; the pool votes the same over training tokens of other
    sequences, the closest M of them; the products let the weight of each depend on how sure the
    regression is. Missing ids (-1) are in no set."""

    name = "depthtime"

    def __init__(self, sc: Sidecar, routers: ModelRouters | None = None):
        self.sc = sc
        self.n_layer, self.n_expert, self.top_k = sc.n_layer, sc.n_expert, sc.top_k
        self.max_lookahead = sc.max_lookahead
        self.gate = depthtime_gate(sc)
        self.n_features = len(depthtime_features(sc))
        if self.gate and routers is None:
            raise _invalid(
                "depthtime: this sidecar weighs the gate feature (depthtime.gate = 1) and needs the model: --model M.gguf"
            )
        self.routers = routers if self.gate else None
        self.t = {k: v.astype(np.float64) for k, v in sc.tensors.items()}
        self._routes: dict = {}  # (sequence, prefix length) -> (L, route match counts [T, T])
        self._routes_of = None  # the trace the cached counts belong to
        self.pool = sc.tensors["dt.pool"].astype(np.int64) if depthtime_pool(sc) else None  # [N, n_layer, k]
        self.neighbours = int(sc.params.get("depthtime.neighbours", 0))
        self._pool_counts: tuple = (None, -1, None)  # (rows key, L done, c [rows, N] for that L)

    def check_trace(self, trace):
        _check_shape(self.name, trace, self.n_layer, self.n_expert, self.top_k)
        if self.routers is not None:
            self.routers.check_trace(self.name, trace)

    def scores_all(self, trace, idx, L):
        out = self._empty(len(idx))
        for t, feats in self.features(trace, idx, L).items():
            out[t - L - 1] = feats @ self.t["dt.stack"][t - L - 1, t]
        return out

    def features(self, trace: RoutingTrace, idx: np.ndarray, L: int) -> dict[int, np.ndarray]:
        """{t: float64 [len(idx), n_expert, self.n_features]} for every target t = L + d,
        d = 1..max_lookahead, t < n_layer."""
        idx = np.asarray(idx, dtype=np.int64)
        targets = [L + d for d in range(1, self.max_lookahead + 1) if L + d < self.n_layer]
        out = {t: np.zeros((len(idx), self.n_expert, self.n_features)) for t in targets}
        prev = trace.prev_index()[idx]
        for t in targets:
            reg = np.broadcast_to(self.t["dt.bias"][t], (len(idx), self.n_expert)).copy()
            for layer in range(L + 1):
                reg += trace.multi_hot(idx, layer) @ self.t["dt.layer"][t, t - layer - 1]
            for r in (-1, 0, 1):
                if 0 <= t + r < self.n_layer:
                    reg += trace.multi_hot(prev, t + r) @ self.t["dt.prev"][t, r + 1]
            out[t][:, :, 0] = reg
            out[t][:, :, 1] = self.t["dt.count_bias"][t] + trace.multi_hot(idx, L) @ self.t["dt.count"][t, t - L - 1]
        seq = np.searchsorted(trace.seq_start, idx, side="right") - 1
        for s in np.unique(seq).tolist():
            rows = np.nonzero(seq == s)[0]
            first = int(trace.seq_start[s])
            at = idx[rows] - first  # positions in the sequence
            for t, f in self._time_features(trace, s, first, int(at.max()) + 1, at, L, targets).items():
                out[t][rows, :, 2 : len(DEPTHTIME_BASE_FEATURES)] = f
        column = {name: i for i, name in enumerate(DEPTHTIME_BASE_FEATURES)}
        for feats in out.values():
            regp = softmax(feats[:, :, column["reg"]])
            for i, (a, b) in enumerate(DEPTHTIME_PRODUCTS, start=len(DEPTHTIME_BASE_FEATURES)):
                feats[:, :, i] = (regp if a == "regp" else feats[:, :, column[a]]) * feats[:, :, column[b]]
        if self.pool is not None and targets:
            base, n_pow = len(DEPTHTIME_FEATURES), len(DEPTHTIME_POOL_POWERS)
            for t, votes in self._pool_votes(trace, idx, L, targets).items():
                feats = out[t]
                feats[:, :, base : base + n_pow] = votes
                feats[:, :, base + n_pow : base + 2 * n_pow] = feats[:, :, column["reg"], None] * votes
                feats[:, :, base + 2 * n_pow : base + 3 * n_pow] = softmax(feats[:, :, column["reg"]])[:, :, None] * votes
        if self.routers is not None and targets:
            hidden = trace.hidden_rows(idx, L)
            for t in targets:
                gate = self.routers.router_logits(hidden, t)
                out[t][:, :, -2] = gate
                out[t][:, :, -1] = softmax(gate)
        return out

    def _pool_hot(self, layer: int) -> np.ndarray:
        """float32 [N, E]: how many slots of each pool token's route at `layer` name each expert."""
        ids = self.pool[:, layer]
        hot = np.zeros((ids.shape[0], self.n_expert), np.float32)
        rows, slots = np.nonzero(ids >= 0)
        np.add.at(hot, (rows, ids[rows, slots]), 1.0)
        return hot

    def _pool_match_counts(self, trace: RoutingTrace, idx: np.ndarray, L: int) -> np.ndarray:
        """c [len(idx), N]: sum_{l<=L} #{slots of Q_i(l) in S(l)} (exact small integers). Kept for the
        last rows and L asked, so the ascending L of evaluate() and of training add one layer per call."""
        key = (id(trace), trace.path, idx.tobytes())
        rows_key, done, counts = self._pool_counts
        if rows_key != key or done > L:
            dtype = np.uint8 if self.top_k * self.n_layer <= np.iinfo(np.uint8).max else np.uint16
            done, counts = -1, np.zeros((len(idx), self.pool.shape[0]), dtype)
        for layer in range(done + 1, L + 1):
            hot = self._pool_hot(layer).T
            for c0 in range(0, len(idx), 2048):
                mine = trace.multi_hot(idx[c0 : c0 + 2048], layer, dtype=np.float32)
                counts[c0 : c0 + 2048] += (mine @ hot).astype(counts.dtype)
        self._pool_counts = (key, L, counts)
        return counts

    def _pool_votes(self, trace: RoutingTrace, idx: np.ndarray, L: int, targets: list) -> dict[int, np.ndarray]:
        """{t: float64 [len(idx), E, len(DEPTHTIME_POOL_POWERS)]}: pvote<p> of each target."""
        counts = self._pool_match_counts(trace, idx, L)
        N, E = counts.shape[1], self.n_expert
        M = min(self.neighbours, N)
        K = self.top_k * (L + 1) + 1  # counts lie in [0, K)
        out = {t: np.zeros((len(idx), E, len(DEPTHTIME_POOL_POWERS))) for t in targets}
        for c0 in range(0, len(idx), 256):  # [256, N] int64 temporaries: 160 MB at N = 80,000
            c = counts[c0 : c0 + 256].astype(np.int64)
            n = c.shape[0]
            # The neighbours: every count above the threshold c*, then ties at c* in index order up
            # to M; c* is the largest count that at least M tokens reach (count 0: all N >= M do).
            hist = np.bincount((np.arange(n)[:, None] * K + c).ravel(), minlength=n * K).reshape(n, K)
            at_least = np.cumsum(hist[:, ::-1], axis=1)[:, ::-1]  # [r, v]: #(c >= v)
            threshold = (at_least >= M).sum(axis=1) - 1
            above = np.where(threshold + 1 < K, at_least[np.arange(n), np.minimum(threshold + 1, K - 1)], 0)
            tie = c == threshold[:, None]
            take = (c > threshold[:, None]) | (tie & (np.cumsum(tie, axis=1) <= (M - above)[:, None]))
            near = np.nonzero(take)[1].reshape(n, M)  # row-major: M ascending pool indices per row
            cn = c[np.arange(n)[:, None], near].astype(np.float64)
            top = cn.max(axis=1, keepdims=True)
            r = np.divide(cn, top, out=np.zeros_like(cn), where=top > 0)
            for t in targets:
                ids = self.pool[near, t]  # [n, M, k]
                valid = ids >= 0
                flat = (np.arange(n)[:, None, None] * E + np.maximum(ids, 0))[valid]
                for q, p in enumerate(DEPTHTIME_POOL_POWERS):
                    w = r**p
                    total = w.sum(axis=1)
                    votes = np.bincount(flat, np.broadcast_to(w[:, :, None], ids.shape)[valid], minlength=n * E)
                    votes = votes.reshape(n, E)
                    out[t][c0 : c0 + n, :, q] = np.divide(votes, total[:, None], out=np.zeros_like(votes), where=total[:, None] > 0)
        return out

    def _hot(self, trace: RoutingTrace, first: int, T: int, layer: int) -> np.ndarray:
        return trace.multi_hot(np.arange(first, first + T), layer)

    def _route_counts(self, trace: RoutingTrace, s: int, first: int, T: int, L: int) -> np.ndarray:
        """float32 [T, T]: sum_{l<=L} |S_i(l) ∩ S_j(l)| for positions i, j of sequence s (integers,
        exact). Kept per sequence for the last L asked, so the ascending L of evaluate() and of
        training add one layer per call."""
        if self._routes_of != (id(trace), trace.path):
            self._routes_of, self._routes = (id(trace), trace.path), {}
        done, counts = self._routes.get((s, T), (-1, None))
        if counts is None or done > L:
            done, counts = -1, np.zeros((T, T), dtype=np.float32)
        for layer in range(done + 1, L + 1):
            h = self._hot(trace, first, T, layer).astype(np.float32)
            counts = counts + h @ h.T
        self._routes[s, T] = (L, counts)
        return counts

    def _time_features(self, trace, s, first, T, at, L, targets) -> dict[int, np.ndarray]:
        """{t: float64 [len(at), n_expert, len(DEPTHTIME_BASE_FEATURES) - 2]}: prev1..4, hist<λ>, freq and
        the votes of each target t for the tokens at positions `at` of sequence s (its first T tokens)."""
        E = self.n_expert
        hots = {t: self._hot(trace, first, T, t) for t in targets}
        out = {t: np.zeros((len(at), E, len(DEPTHTIME_BASE_FEATURES) - 2)) for t in targets}
        decays = np.asarray(DEPTHTIME_DECAYS)[:, None]
        c = 4 + len(DEPTHTIME_DECAYS)
        for t, hot in hots.items():
            for j in range(1, 5):
                ok = at >= j
                out[t][ok, :, j - 1] = hot[at[ok] - j]
            hist = np.zeros((T, len(DEPTHTIME_DECAYS), E))
            for i in range(1, T):
                hist[i] = decays * hist[i - 1] + hot[i - 1]
            out[t][:, :, 4:c] = hist[at].transpose(0, 2, 1)
            earlier = np.cumsum(hot, axis=0) - hot  # counts over positions < i
            out[t][:, :, c] = earlier[at] / np.maximum(at, 1)[:, None]
        m = self._route_counts(trace, s, first, T, L)[at].astype(np.float64) / (self.top_k * (L + 1))
        j = np.arange(T)[None, :]
        m[(j >= at[:, None]) | (j < at[:, None] - DEPTHTIME_VOTE_WINDOW)] = 0.0  # only earlier tokens in the window vote
        all_hot = np.concatenate([hots[t] for t in targets], axis=1)  # [T, len(targets) * E]
        n_pow = len(DEPTHTIME_VOTE_POWERS)
        for q, p in enumerate(DEPTHTIME_VOTE_POWERS):
            w = m**p
            votes = w @ all_hot
            total = np.maximum(w.sum(axis=1), 1e-6)[:, None]
            for n, t in enumerate(targets):
                vote = votes[:, n * E : (n + 1) * E]
                out[t][:, :, c + 1 + q] = vote
                out[t][:, :, c + 1 + n_pow + q] = vote / total
        return out


class LearnedPredictor(ReferencePredictor):
    """Per source layer MLP over the RMS-normalised (optionally PCA-compressed) hidden state."""

    name = "learned"

    def __init__(self, sc: Sidecar):
        self.sc = sc
        self.n_layer, self.n_expert, self.top_k = sc.n_layer, sc.n_expert, sc.top_k
        self.max_lookahead = sc.max_lookahead
        self.n_embd, self.rank = sc.params["n_embd"], sc.params["learned.rank"]
        self.t = {k: v.astype(np.float64) for k, v in sc.tensors.items()}

    def check_trace(self, trace):
        _check_shape(self.name, trace, self.n_layer, self.n_expert, self.top_k)
        if trace.hidden is None or trace.n_embd != self.n_embd:
            raise _invalid(
                f"predictor learned needs hidden states of width {self.n_embd}; trace {trace.path} "
                f"has {'none' if trace.hidden is None else trace.n_embd}"
            )

    def forward(self, hidden: np.ndarray, L: int) -> np.ndarray:
        """hidden float64 [N, n_embd] -> [N, max_lookahead * E] (rows (d-1)E..dE score L+d)."""
        t = self.t
        x = rms_norm(hidden, LEARNED_RMS_EPS)
        z = (x - t[f"learned.{L}.pca_mean"]) @ t[f"learned.{L}.pca"].T if self.rank > 0 else x
        a = np.maximum(z @ t[f"learned.{L}.w1"].T + t[f"learned.{L}.b1"], 0.0)
        return a @ t[f"learned.{L}.w2"].T + t[f"learned.{L}.b2"]

    def scores_all(self, trace, idx, L):
        out = self._empty(len(idx))
        if L >= self.n_layer - 1:
            return out
        s = self.forward(trace.hidden_rows(idx, L), L)
        for d in range(1, self.max_lookahead + 1):
            if L + d < self.n_layer:
                out[d - 1] = s[:, (d - 1) * self.n_expert : d * self.n_expert]
        return out


class TrajectoryPredictor(ReferencePredictor):
    """The tiny pre-LN transformer over the last up-to-`window` layers' choices plus one slot for the
    previous token's choices at L+1..L+max_lookahead (spec: docs/predictors.md, trajectory).

    Head split: qkv rows [0, D) are q, [D, 2D) k, [2D, 3D) v; head h uses columns [h*D/H, (h+1)*D/H)
    of each."""

    name = "trajectory"

    def __init__(self, sc: Sidecar):
        self.sc = sc
        self.n_layer, self.n_expert, self.top_k = sc.n_layer, sc.n_expert, sc.top_k
        self.max_lookahead = sc.max_lookahead
        p = sc.params
        self.window, self.d_model = p["trajectory.window"], p["trajectory.d_model"]
        self.n_block, self.n_head = p["trajectory.n_block"], p["trajectory.n_head"]
        self.t = {k: v.astype(np.float64) for k, v in sc.tensors.items()}

    def check_trace(self, trace):
        _check_shape(self.name, trace, self.n_layer, self.n_expert, self.top_k)

    def inputs(self, cur_ids: np.ndarray, prev_ids: np.ndarray, has_prev: np.ndarray, L: int) -> np.ndarray:
        """cur_ids int [N, n_layer, k] (the token's selections; only layers <= L are read),
        prev_ids int [N, n_layer, k] (previous token's), has_prev bool [N] -> x float64 [N, n, D]."""
        t, N, D = self.t, cur_ids.shape[0], self.d_model
        n = min(self.window, L + 1) + 1
        x = np.empty((N, n, D))
        for j, s in enumerate(range(L - n + 2, L + 1)):
            hot = ids_to_multi_hot(cur_ids[:, s], self.n_expert)
            x[:, j] = t["traj.layer_emb"][s] + hot @ t["traj.expert_emb"][s]
        last = np.zeros((N, D))
        for d in range(1, self.max_lookahead + 1):
            if L + d < self.n_layer:
                last += ids_to_multi_hot(prev_ids[:, L + d], self.n_expert) @ t["traj.prev_emb"][L + d]
        x[:, n - 1] = np.where(has_prev[:, None], last, t["traj.prev_none"])
        return x

    def encode(self, x: np.ndarray) -> np.ndarray:
        """x [N, n, D] -> y [N, D]: the blocks, then LN_f at the position of layer L (index n-2)."""
        t, D, H = self.t, self.d_model, self.n_head
        N, n, _ = x.shape
        dh = D // H
        for b in range(self.n_block):
            p = f"traj.blk.{b}."
            h = layer_norm(x, t[p + "ln1.w"], t[p + "ln1.b"])
            qkv = linear(h, t[p + "qkv.w"], t[p + "qkv.b"])
            q, k, v = (
                qkv[..., i * D : (i + 1) * D].reshape(N, n, H, dh).transpose(0, 2, 1, 3) for i in range(3)
            )
            att = q @ k.transpose(0, 1, 3, 2) / math.sqrt(dh)
            att = softmax(att)
            ctx = (att @ v).transpose(0, 2, 1, 3).reshape(N, n, D)
            x = x + linear(ctx, t[p + "out.w"], t[p + "out.b"])
            h = layer_norm(x, t[p + "ln2.w"], t[p + "ln2.b"])
            x = x + linear(gelu(linear(h, t[p + "up.w"], t[p + "up.b"])), t[p + "down.w"], t[p + "down.b"])
        return layer_norm(x[:, n - 2], t["traj.ln_f.w"], t["traj.ln_f.b"])

    def scores_all(self, trace, idx, L, chunk: int = 4096):
        out = self._empty(len(idx))
        if L >= self.n_layer - 1:
            return out
        prev = trace.prev_index()[idx]
        for c0 in range(0, len(idx), chunk):  # bounds the [chunk, n, 3D] temporaries
            ci, cp = idx[c0 : c0 + chunk], prev[c0 : c0 + chunk]
            cur_ids = trace.experts[ci].astype(np.int64)
            prev_ids = trace.experts[np.maximum(cp, 0)].astype(np.int64)
            y = self.encode(self.inputs(cur_ids, prev_ids, cp >= 0, L))
            for d in range(1, self.max_lookahead + 1):
                if L + d < self.n_layer:
                    out[d - 1, c0 : c0 + chunk] = (
                        y @ self.t[f"traj.head.{d}.w"][L + d].T + self.t[f"traj.head.{d}.b"][L + d]
                    )
        return out


# ------------------------------------------------------------------------------------------------
# Predictors that read the model's routers
# ------------------------------------------------------------------------------------------------


class ModelRouters:
    """The f32 (dequantized) ffn_norm, router and pre-gate weights of a model GGUF, per MoE layer.

    `layer_blocks[l]` is the decoder block of MoE layer l (the trace's moe_layer_ids); by default
    every block. Reads everything at construction and closes the file."""

    def __init__(self, path: str | os.PathLike, layer_blocks: np.ndarray | None = None):
        import gguf
        from gguf.quants import dequantize

        from sharpi._core import FormatError, MissingTensorError

        self.path = str(path)
        if not os.path.isfile(self.path):
            raise _invalid(f"model {self.path}: no such file")
        try:
            reader = gguf.GGUFReader(self.path)
        except Exception as e:  # noqa: BLE001 -- gguf raises untyped errors (ValueError, struct.error, ...) on garbage
            raise FormatError(
                f"model {self.path}: not a readable GGUF file ({type(e).__name__}: {e})"
            ) from None
        arch_field = reader.fields.get("general.architecture")
        if arch_field is None:
            raise FormatError(f"model {self.path}: missing key 'general.architecture'")
        self.arch = str(arch_field.contents())
        eps_key = f"{self.arch}.attention.layer_norm_rms_epsilon"
        if eps_key not in reader.fields:
            raise FormatError(f"model {self.path}: missing key '{eps_key}'")
        self.rms_eps = float(reader.fields[eps_key].contents())
        self.n_block = int(reader.fields[f"{self.arch}.block_count"].contents())
        self.layer_blocks = (
            np.arange(self.n_block) if layer_blocks is None else np.asarray(layer_blocks)
        ).tolist()
        tensors = {t.name: t for t in reader.tensors}

        def load(name: str, required: bool) -> np.ndarray | None:
            t = tensors.get(name)
            if t is None:
                if required:
                    raise MissingTensorError(f"model {self.path}: missing tensor '{name}'")
                return None
            shape = tuple(int(v) for v in reversed(t.shape.tolist()))
            return dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float64)

        self.ffn_norm = [load(f"blk.{b}.ffn_norm.weight", True) for b in self.layer_blocks]
        self.gate = [load(f"blk.{b}.ffn_gate_inp.weight", True) for b in self.layer_blocks]
        self.pregate = [load(f"blk.{b}.ffn_pregate_inp.weight", False) for b in self.layer_blocks]
        self.n_expert, self.n_embd = self.gate[0].shape
        for il, (g, w) in enumerate(zip(self.gate, self.ffn_norm)):
            if g.shape != (self.n_expert, self.n_embd) or w.shape != (self.n_embd,):
                raise FormatError(
                    f"model {self.path}: block {self.layer_blocks[il]} router {g.shape} / ffn_norm "
                    f"{w.shape} do not match [{self.n_expert}, {self.n_embd}]"
                )

    @property
    def n_layer(self) -> int:
        return len(self.layer_blocks)

    def normed(self, hidden: np.ndarray, layer: int) -> np.ndarray:
        """ffn_norm of MoE layer `layer` applied to hidden [N, n_embd] (RMSNorm with its weight)."""
        return rms_norm(hidden, self.rms_eps) * self.ffn_norm[layer]

    def router_logits(self, hidden: np.ndarray, layer: int) -> np.ndarray:
        """The real gate of MoE layer `layer` on its own MoE input hidden [N, n_embd] -> [N, E]."""
        return self.normed(hidden, layer) @ self.gate[layer].T

    def check_trace(self, name: str, trace: RoutingTrace) -> None:
        if trace.hidden is None:
            raise _invalid(f"predictor {name} needs hidden states; trace {trace.path} has none")
        if (trace.n_layer, trace.n_expert, trace.n_embd) != (self.n_layer, self.n_expert, self.n_embd):
            raise _invalid(
                f"predictor {name}: model {self.path} has {self.n_layer} MoE layers, {self.n_expert} "
                f"experts, n_embd {self.n_embd}; trace {trace.path} has {trace.n_layer}, "
                f"{trace.n_expert}, {trace.n_embd}"
            )


class NextGatePredictor(ReferencePredictor):
    """Layer L+d's router applied to ffn_norm_{L+d}(hidden_L): training-free."""

    name = "next_gate"

    def __init__(self, model: ModelRouters, max_lookahead: int = 3):
        self.model, self.n_expert, self.max_lookahead = model, model.n_expert, max_lookahead

    def check_trace(self, trace):
        self.model.check_trace(self.name, trace)

    def scores_all(self, trace, idx, L):
        out = self._empty(len(idx))
        hidden = trace.hidden_rows(idx, L)
        for d in range(1, self.max_lookahead + 1):
            if L + d < self.model.n_layer:
                out[d - 1] = self.model.router_logits(hidden, L + d)
        return out


class PregatePredictor(ReferencePredictor):
    """Layer N+1 from blk.N.ffn_pregate_inp.weight @ ffn_norm_N(hidden_N); d = 1 only."""

    name = "pregate"
    max_lookahead = 1

    def __init__(self, model: ModelRouters):
        self.model, self.n_expert = model, model.n_expert
        missing = [model.layer_blocks[il] for il in range(model.n_layer - 1) if model.pregate[il] is None]
        if missing:
            from sharpi._core import MissingTensorError

            raise MissingTensorError(
                f"model {model.path}: predictor pregate needs blk.N.ffn_pregate_inp.weight; "
                f"missing for blocks {missing} (train it with `sharpi predictor train "
                "--kind pregate`)"
            )
        for il in range(model.n_layer - 1):
            if model.pregate[il].shape != (model.n_expert, model.n_embd):
                from sharpi._core import FormatError

                raise FormatError(
                    f"model {model.path}: blk.{model.layer_blocks[il]}.ffn_pregate_inp.weight has "
                    f"shape {model.pregate[il].shape}, expected {(model.n_expert, model.n_embd)}"
                )

    def check_trace(self, trace):
        self.model.check_trace(self.name, trace)

    def scores_all(self, trace, idx, L):
        out = self._empty(len(idx))
        if L + 1 < self.model.n_layer:
            out[0] = self.model.normed(trace.hidden_rows(idx, L), L) @ self.model.pregate[L].T
        return out


def sidecar_predictor(sc: Sidecar, routers: ModelRouters | None = None) -> ReferencePredictor:
    """The reference of sidecar sc; `routers` for a depthtime sidecar with the gate feature."""
    if sc.kind == "depthtime":
        return DepthTimePredictor(sc, routers)
    return {"cooc": CoocPredictor, "learned": LearnedPredictor, "trajectory": TrajectoryPredictor}[sc.kind](sc)


PREDICTOR_NAMES = ("prev_token", "cooc", "depthtime", "learned", "trajectory", "next_gate", "pregate")


def make_predictor(
    name: str, trace: RoutingTrace, file: str | None = None, model: str | None = None
) -> ReferencePredictor:
    """The reference predictor NAME for `trace`: sidecar kinds need `file`, next_gate and pregate the
    model GGUF (pregate may take its pre-gate weights from `file`, a model copy written by training)."""
    if name not in PREDICTOR_NAMES:
        raise _invalid(f"unknown predictor '{name}' (one of {', '.join(PREDICTOR_NAMES)})")
    if name == "prev_token":
        p: ReferencePredictor = PrevTokenPredictor(trace.n_expert)
    elif name in ("cooc", "depthtime", "learned", "trajectory"):
        if file is None:
            raise _invalid(f"predictor {name} needs a sidecar file: --predictor {name}:FILE")
        sc = read_sidecar(file, kind=name, n_layer=trace.n_layer, n_expert=trace.n_expert, top_k=trace.top_k)
        # A depthtime sidecar with the gate feature needs the model's routers (DepthTimePredictor says so).
        routers = ModelRouters(model, trace.moe_layer_ids) if name == "depthtime" and depthtime_gate(sc) and model else None
        p = sidecar_predictor(sc, routers)
    else:
        source = file if (name == "pregate" and file) else model
        if source is None:
            raise _invalid(
                f"predictor {name} needs the model: --model M.gguf"
                + (" (or --predictor pregate:MODEL_WITH_PREGATE.gguf)" if name == "pregate" else "")
            )
        routers = ModelRouters(source, trace.moe_layer_ids)
        p = NextGatePredictor(routers) if name == "next_gate" else PregatePredictor(routers)
    p.check_trace(trace)
    return p
