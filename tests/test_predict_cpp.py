"""C++ sidecar predictors (cooc, depthtime, learned, trajectory) against float64 numpy implementations.

The sidecar files are written here with gguf.GGUFWriter straight from docs/predictors.md (no other
sharpi code writes them), with random weights, and the scores of every formula in that spec are
recomputed here in float64 numpy. The C++ scores must agree to ~1e-4 (relative to the scores'
scale) for many random inputs, layers and lookaheads; observe() must return exactly the top-k of
the numpy scores per target layer wherever the k-th and (k+1)-th scores are clearly apart.
Malformed or mismatched files must raise the typed errors the spec names, never crash.

The Model a sidecar is checked against is a tiny model written by sharpi.make_model (the code
behind `sharpi make-model`).
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
from sharpi import _core, _internal
from sharpi.make_model import write_model

if not hasattr(_internal, "load_predictor"):
    pytest.skip(
        "sharpi._core has no load_predictor (bind_predict not called in module.cpp)", allow_module_level=True
    )

N_LAYER, N_EMBD, N_EXPERT, TOP_K = 12, 64, 8, 2
PREFIX = "sharpi.predictor."


# ---- files ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("predict_cpp") / "tiny.gguf")
    write_model(
        path,
        preset="tiny",
        quant="f32",
        seed=3,
        n_layer=N_LAYER,
        n_embd=N_EMBD,
        n_head=4,
        n_head_kv=2,
        n_expert=N_EXPERT,
        n_expert_used=TOP_K,
        n_ff=64,
        n_ff_exp=64,
        vocab_size=512,
    )
    return path


def write_sidecar(
    path,
    kind,
    keys,
    tensors,
    *,
    n_layer=N_LAYER,
    n_expert=N_EXPERT,
    top_k=TOP_K,
    max_lookahead=3,
    arch="sharpi.predictor",
    dtypes=None,
):
    """A sidecar per docs/predictors.md: common keys, `keys` (suffix -> uint32), f32 tensors in numpy
    shape (GGUFWriter stores them reversed, as GGUF wants). dtypes: {name: numpy dtype} overrides."""
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_string(PREFIX + "kind", kind)
    w.add_uint32(PREFIX + "n_layer", n_layer)
    w.add_uint32(PREFIX + "n_expert", n_expert)
    w.add_uint32(PREFIX + "top_k", top_k)
    w.add_uint32(PREFIX + "max_lookahead", max_lookahead)
    w.add_string(PREFIX + "source", "random weights, test_predict_cpp.py")
    for key, value in keys.items():
        w.add_uint32(PREFIX + key, value)
    for name, arr in tensors.items():
        dtype = (dtypes or {}).get(name, np.float32)
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def cooc_params(rng, m, max_la, n_layer=N_LAYER, E=N_EXPERT):
    n_off = max_la + m - 1
    keys = {"cooc.history": m}
    tensors = {
        "cooc.bias": rng.normal(size=(n_layer, E)),
        "cooc.layer": rng.normal(size=(n_layer, n_off, E, E)),
        "cooc.prev": rng.normal(size=(n_layer, E, E)),
    }
    return keys, tensors


# reg, cnt, prev1..4, hist0.5/0.8/0.9/0.97, freq, vote1/4/16, nvote1/4/16, then 16 products of two
DT_BASE = 17
DT_PRODUCTS = [(a, v) for a in ("reg", "regp") for v in range(11, 17)] + [("reg", 2), ("reg", 8), ("reg", 10), ("cnt", 15)]
DT_FEATURES = DT_BASE + len(DT_PRODUCTS)
DT_DECAYS, DT_POWERS, DT_WINDOW = (0.5, 0.8, 0.9, 0.97), (1, 4, 16), 1024
# With a pool (depthtime.pool = N > 0): pvote4/16/64, reg * pvote<p>, regp * pvote<p> after the 33
DT_POOL_POWERS = (4, 16, 64)
DT_POOL = 3 * len(DT_POOL_POWERS)


def random_pool(rng, n, unknown=0.05):
    """n pool tokens' routes [n, N_LAYER, TOP_K]: distinct experts per layer, a few cells -1."""
    layers = range(N_LAYER)
    routes = np.array([[rng.choice(N_EXPERT, TOP_K, replace=False) for _ in layers] for _ in range(n)])
    routes[rng.random(routes.shape) < unknown] = -1
    return routes


def depthtime_params(rng, max_la, n_layer=N_LAYER, E=N_EXPERT, history=False, gate=False, pool=None):
    """history=False: every time feature (prev1.. onwards) weighs 0, so scores do not depend on the
    tokens observed before (the random-input checks); True: every feature weighs something. Some
    targets keep one feature alone, as training does where that recalls best. gate: depthtime.gate
    = 1, two more columns (the router on the hidden state, its softmax), alone on some targets, 0 on
    others. pool: (routes [N, n_layer, top_k], M): depthtime.pool = N, .neighbours = M, dt.pool, and
    the 9 pool columns before the gate's, random, alone on some targets, 0 on others."""
    pooled = pool is not None
    gate_col = DT_FEATURES + DT_POOL * int(pooled)
    n_feat = gate_col + 2 * int(gate)
    stack = rng.normal(size=(max_la, n_layer, n_feat))
    if not history:
        stack[..., 2:DT_FEATURES] = 0.0
    stack[0, ::3, 1:] = 0.0  # the regression alone
    stack[0, 1::3, [0, 2]] = 0.0  # no regression, no prev1
    stack[-1, ::4, :] = np.eye(n_feat)[1]  # the counts alone, unscaled
    if history:
        stack[-1, 1::4, :] = np.eye(n_feat)[11]  # vote1 alone
        stack[-1, 2::4, :] = np.eye(n_feat)[DT_BASE + 7]  # regp * vote4 alone
    if pooled:  # (stack[0, ::3] above: no pool feature)
        stack[0, 1::6, :] = np.eye(n_feat)[DT_FEATURES]  # pvote4 alone
        stack[-1, 3::8, :] = np.eye(n_feat)[DT_FEATURES + 7]  # regp * pvote16 alone
        stack[-1, 6::8, :] = np.eye(n_feat)[DT_FEATURES + 4]  # reg * pvote16 alone
        stack[-1, 7::8, :] = np.eye(n_feat)[DT_FEATURES + 2]  # pvote64 alone
    if gate:
        stack[0, 2::3, :] = np.eye(n_feat)[gate_col]  # the gate alone
        stack[0, 2::6, :] = np.eye(n_feat)[gate_col + 1]  # its softmax alone
        stack[-1, 3::4, gate_col:] = 0.0  # no gate
    tensors = {
        "dt.bias": rng.normal(size=(n_layer, E)),
        "dt.layer": rng.normal(size=(n_layer, n_layer - 1, E, E)),
        "dt.prev": rng.normal(size=(n_layer, 3, E, E)),
        "dt.count_bias": rng.normal(size=(n_layer, E)),
        "dt.count": rng.normal(size=(n_layer, max_la, E, E)),
        "dt.stack": stack,
    }
    keys = {"depthtime.gate": 1} if gate else {}
    if pooled:
        routes, neighbours = pool
        keys |= {"depthtime.pool": len(routes), "depthtime.neighbours": neighbours}
        tensors["dt.pool"] = np.asarray(routes, dtype=np.float32)
    return keys, tensors


def learned_params(rng, hidden, rank, max_la, n_layer=N_LAYER, E=N_EXPERT, n_embd=N_EMBD):
    keys = {"n_embd": n_embd, "learned.hidden": hidden, "learned.rank": rank}
    tensors = {}
    width = rank if rank > 0 else n_embd
    for il in range(n_layer - 1):
        p = f"learned.{il}."
        if rank > 0:
            tensors[p + "pca_mean"] = rng.normal(scale=0.3, size=n_embd)
            tensors[p + "pca"] = rng.normal(scale=1 / math.sqrt(n_embd), size=(rank, n_embd))
        tensors[p + "w1"] = rng.normal(scale=1 / math.sqrt(width), size=(hidden, width))
        tensors[p + "b1"] = rng.normal(scale=0.3, size=hidden)
        tensors[p + "w2"] = rng.normal(scale=1 / math.sqrt(hidden), size=(max_la * E, hidden))
        tensors[p + "b2"] = rng.normal(scale=0.3, size=max_la * E)
    return keys, tensors


def trajectory_params(rng, W, D, n_block, n_head, F, max_la, n_layer=N_LAYER, E=N_EXPERT):
    keys = {
        "trajectory.window": W,
        "trajectory.d_model": D,
        "trajectory.n_block": n_block,
        "trajectory.n_head": n_head,
        "trajectory.d_ff": F,
    }
    t = {
        "traj.expert_emb": rng.normal(size=(n_layer, E, D)),
        "traj.layer_emb": rng.normal(size=(n_layer, D)),
        "traj.prev_emb": rng.normal(size=(n_layer, E, D)),
        "traj.prev_none": rng.normal(size=D),
    }
    for b in range(n_block):
        p = f"traj.blk.{b}."
        t[p + "ln1.w"] = 1 + 0.2 * rng.normal(size=D)
        t[p + "ln1.b"] = 0.2 * rng.normal(size=D)
        t[p + "qkv.w"] = rng.normal(scale=1.5 / math.sqrt(D), size=(3 * D, D))
        t[p + "qkv.b"] = 0.2 * rng.normal(size=3 * D)
        t[p + "out.w"] = rng.normal(scale=1 / math.sqrt(D), size=(D, D))
        t[p + "out.b"] = 0.2 * rng.normal(size=D)
        t[p + "ln2.w"] = 1 + 0.2 * rng.normal(size=D)
        t[p + "ln2.b"] = 0.2 * rng.normal(size=D)
        t[p + "up.w"] = rng.normal(scale=1 / math.sqrt(D), size=(F, D))
        t[p + "up.b"] = 0.2 * rng.normal(size=F)
        t[p + "down.w"] = rng.normal(scale=1 / math.sqrt(F), size=(D, F))
        t[p + "down.b"] = 0.2 * rng.normal(size=D)
    t["traj.ln_f.w"] = 1 + 0.2 * rng.normal(size=D)
    t["traj.ln_f.b"] = 0.2 * rng.normal(size=D)
    for d in range(1, max_la + 1):
        t[f"traj.head.{d}.w"] = rng.normal(scale=1 / math.sqrt(D), size=(n_layer, E, D))
        t[f"traj.head.{d}.b"] = 0.2 * rng.normal(size=(n_layer, E))
    return keys, t


# ---- float64 references (docs/predictors.md) -----------------------------------------------------


def f64(tensors):
    """The weights exactly as the file holds them (rounded to f32), in float64."""
    return {name: np.asarray(a, dtype=np.float32).astype(np.float64) for name, a in tensors.items()}


def selected(row):
    return [int(i) for i in row if i >= 0]


def cooc_ref(w, keys, L, d, history, prev):
    m = keys["cooc.history"]
    t = L + d
    s = w["cooc.bias"][t].copy()
    for o in range(d, d + m):
        if t - o < 0:
            break
        for i in selected(history[t - o]):
            s += w["cooc.layer"][t, o - 1, i]
    for i in selected(prev[t]):
        s += w["cooc.prev"][t, i]
    return s


def pool_votes_ref(pool, L, t, history):
    """pvote<p> for p in DT_POOL_POWERS, float64 [E] each, by brute force over the pool: c_i counts the
    slots of pool token i's route at layers 0..L that name an expert of the current token's set there;
    the M tokens of largest c_i vote (ties: the lower index), each r_i^p = (c_i / max c)^p for each
    slot of its route at t, over the sum of r_i^p. All 0 when max c = 0."""
    routes, M = pool
    sets = [set(selected(history[layer])) for layer in range(L + 1)]
    c = [sum(e in sets[layer] for layer in range(L + 1) for e in selected(route[layer])) for route in routes]
    near = sorted(range(len(routes)), key=lambda i: (-c[i], i))[:M]
    top = max(c)
    votes = []
    for p in DT_POOL_POWERS:
        f = np.zeros(N_EXPERT)
        if top > 0:
            for i in near:
                for e in selected(routes[i][t]):
                    f[e] += (c[i] / top) ** p
            f /= sum((c[i] / top) ** p for i in near)
        votes.append(f)
    return votes


def depthtime_ref(w, L, d, history, prev, earlier=(), window=DT_WINDOW, gate=None, pool=None):
    """The spec's features one by one, in float64. earlier: the sequence's earlier tokens' full
    selections [N_LAYER, TOP_K], oldest first (earlier[-1] is the previous token). gate: float64
    [E], layer t's router on the hidden state (with its softmax, the last two features of a sidecar
    with depthtime.gate). pool: (routes, M) of a sidecar with depthtime.pool (the 9 pool features
    after the 33)."""
    t = L + d
    reg = w["dt.bias"][t].copy()
    for layer in range(L + 1):
        for i in selected(history[layer]):
            reg += w["dt.layer"][t, t - layer - 1, i]
    for r in (-1, 0, 1):
        if 0 <= t + r < N_LAYER:
            for i in selected(prev[t + r]):
                reg += w["dt.prev"][t, r + 1, i]
    count = w["dt.count_bias"][t].copy()
    for i in selected(history[L]):
        count += w["dt.count"][t, d - 1, i]
    feats = [reg, count]
    n = len(earlier)
    back = [earlier[n - j] for j in range(1, n + 1)]  # back[j-1]: the token j steps back
    for j in range(1, 5):
        f = np.zeros(N_EXPERT)
        if j <= n:
            f[selected(back[j - 1][t])] = 1.0
        feats.append(f)
    for lam in DT_DECAYS:
        f = np.zeros(N_EXPERT)
        for j in range(1, n + 1):
            for i in selected(back[j - 1][t]):
                f[i] += lam ** (j - 1)
        feats.append(f)
    f = np.zeros(N_EXPERT)
    for tok in back:
        for i in selected(tok[t]):
            f[i] += 1.0 / n
    feats.append(f)
    m = []
    for tok in back[:window]:
        shared = sum(len(set(selected(history[layer])) & set(selected(tok[layer]))) for layer in range(L + 1))
        m.append(shared / (TOP_K * (L + 1)))
    votes, totals = [], []
    for p in DT_POWERS:
        f = np.zeros(N_EXPERT)
        for mj, tok in zip(m, back):
            for i in selected(tok[t]):
                f[i] += mj**p
        votes.append(f)
        totals.append(sum(mj**p for mj in m))
    feats += votes + [v / max(total, 1e-6) for v, total in zip(votes, totals)]
    regp = np.exp(reg - reg.max())
    regp /= regp.sum()
    for a, b in DT_PRODUCTS:
        feats.append((regp if a == "regp" else feats[0] if a == "reg" else feats[1]) * feats[b])
    assert len(feats) == DT_FEATURES
    if pool is not None:
        votes = pool_votes_ref(pool, L, t, history)
        feats += votes + [reg * v for v in votes] + [regp * v for v in votes]
    if w["dt.stack"].shape[-1] == len(feats) + 2:
        gatep = np.exp(gate - gate.max())
        feats += [gate, gatep / gatep.sum()]
    return sum(wf * f for wf, f in zip(w["dt.stack"][d - 1, t], feats, strict=True))


def learned_ref(w, keys, L, d, hidden):
    E = N_EXPERT
    p = f"learned.{L}."
    h = hidden.astype(np.float64)
    x = h / np.sqrt(np.mean(h * h) + 1e-6)
    z = w[p + "pca"] @ (x - w[p + "pca_mean"]) if keys["learned.rank"] > 0 else x
    a = np.maximum(w[p + "w1"] @ z + w[p + "b1"], 0.0)
    s = w[p + "w2"] @ a + w[p + "b2"]
    return s[(d - 1) * E : d * E]


def layer_norm(x, weight, bias):
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-5) * weight + bias


_erf = np.vectorize(math.erf)


def trajectory_ref(w, keys, max_la, L, d, history, prev):
    W, D, H = keys["trajectory.window"], keys["trajectory.d_model"], keys["trajectory.n_head"]
    hd = D // H
    n = min(W, L + 1) + 1
    rows = []
    for s in range(L - n + 2, L + 1):
        x = w["traj.layer_emb"][s].copy()
        for i in selected(history[s]):
            x += w["traj.expert_emb"][s, i]
        rows.append(x)
    if (prev >= 0).any():
        x = np.zeros(D)
        for dd in range(1, max_la + 1):
            if L + dd < N_LAYER:
                for i in selected(prev[L + dd]):
                    x += w["traj.prev_emb"][L + dd, i]
    else:
        x = w["traj.prev_none"].copy()
    rows.append(x)
    X = np.stack(rows)
    for b in range(keys["trajectory.n_block"]):
        p = f"traj.blk.{b}."
        h = layer_norm(X, w[p + "ln1.w"], w[p + "ln1.b"])
        qkv = h @ w[p + "qkv.w"].T + w[p + "qkv.b"]
        q, k, v = qkv[:, :D], qkv[:, D : 2 * D], qkv[:, 2 * D :]
        att = np.zeros_like(X)
        for head in range(H):
            sl = slice(head * hd, (head + 1) * hd)
            logits = q[:, sl] @ k[:, sl].T / math.sqrt(hd)
            probs = np.exp(logits - logits.max(axis=1, keepdims=True))
            probs /= probs.sum(axis=1, keepdims=True)
            att[:, sl] = probs @ v[:, sl]
        X = X + att @ w[p + "out.w"].T + w[p + "out.b"]
        u = layer_norm(X, w[p + "ln2.w"], w[p + "ln2.b"]) @ w[p + "up.w"].T + w[p + "up.b"]
        X = X + (0.5 * u * (1 + _erf(u / math.sqrt(2)))) @ w[p + "down.w"].T + w[p + "down.b"]
    y = layer_norm(X[n - 2], w["traj.ln_f.w"], w["traj.ln_f.b"])
    return w[f"traj.head.{d}.w"][L + d] @ y + w[f"traj.head.{d}.b"][L + d]


# ---- inputs --------------------------------------------------------------------------------------


def random_routing(rng, L, with_prev):
    """history: distinct experts for layers 0..L, -1 after; prev: a full token or all -1."""
    history = np.full((N_LAYER, TOP_K), -1, dtype=np.int32)
    for s in range(L + 1):
        history[s] = rng.choice(N_EXPERT, TOP_K, replace=False)
    prev = np.full((N_LAYER, TOP_K), -1, dtype=np.int32)
    if with_prev:
        for s in range(N_LAYER):
            prev[s] = rng.choice(N_EXPERT, TOP_K, replace=False)
    return history, prev


def random_input(rng, L, with_prev):
    hidden = (rng.normal(size=N_EMBD) * rng.uniform(0.1, 10)).astype(np.float32)
    logits = rng.normal(size=N_EXPERT).astype(np.float32)
    history, prev = random_routing(rng, L, with_prev)
    return hidden, logits, history, prev


def assert_scores_close(got, want, what):
    assert got is not None, what
    assert got.dtype == np.float32 and got.shape == (N_EXPERT,), what
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale, err_msg=what)


def check_scores(handle, ref, max_la, lookahead, rng, n_cases):
    """ref(L, d, hidden, history, prev) -> float64 scores. Covers every layer, every d up to
    max_la + 1 (past max_la and past the last layer must give None), with and without prev."""
    for case in range(n_cases):
        L = case % N_LAYER
        with_prev = bool(rng.integers(2))
        hidden, logits, history, prev = random_input(rng, L, with_prev)
        for d in range(1, max_la + 2):
            got = handle.scores(L, d, hidden, logits, history, prev)
            if d > max_la or L + d >= N_LAYER:
                assert got is None, (L, d)
                continue
            assert_scores_close(got, ref(L, d, hidden, history, prev), f"L={L} d={d} prev={with_prev}")


def check_observe(handle, ref, lookahead, rng, n_cases):
    """observe() = the top-k of the reference scores per target layer, best first, whenever the
    k-th and (k+1)-th reference scores are more than 1e-3 apart (and in either order where two of
    the top k are not: the pool votes tie experts that the same neighbours chose)."""
    checked = 0
    for case in range(n_cases):
        L = case % N_LAYER
        hidden, logits, history, prev = random_input(rng, L, bool(rng.integers(2)))
        hints = handle.observe(L, hidden, logits, history, prev)
        targets = [t for t in range(L + 1, L + lookahead + 1) if t < N_LAYER]
        assert sorted({h[0] for h in hints}) == targets
        for t in targets:
            mine = [(e, s) for (tt, e, s) in hints if tt == t]
            assert len(mine) == TOP_K
            want = ref(L, t - L, hidden, history, prev)
            order = sorted(range(N_EXPERT), key=lambda e: (-want[e], e))
            if want[order[TOP_K - 1]] - want[order[TOP_K]] <= 1e-3:
                continue
            got = [e for e, _ in mine]
            if np.diff(want[order[:TOP_K]]).max() >= -1e-3:  # a near tie inside the top k: either order
                assert sorted(got) == sorted(order[:TOP_K]), (L, t)
                order[:TOP_K] = got
            assert got == order[:TOP_K], (L, t)
            np.testing.assert_allclose([s for _, s in mine], want[order[:TOP_K]], rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked > n_cases // 2  # the gap condition must not skip most cases


# ---- cooc ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("m,max_la,lookahead", [(1, 1, 1), (3, 3, 2), (5, 2, 2)])
def test_cooc_scores_and_hints(model, tmp_path, m, max_la, lookahead):
    rng = np.random.default_rng(100 + m)
    keys, tensors = cooc_params(rng, m, max_la)
    path = write_sidecar(tmp_path / "cooc.gguf", "cooc", keys, tensors, max_lookahead=max_la)
    h = _internal.load_predictor("cooc", path, model, lookahead)
    assert h.name == "cooc" and h.lookahead == lookahead
    w = f64(tensors)

    def ref(L, d, hidden, history, prev):
        return cooc_ref(w, keys, L, d, history, prev)

    check_scores(h, ref, max_la, lookahead, rng, 60)
    check_observe(h, ref, lookahead, rng, 60)


# ---- depthtime -----------------------------------------------------------------------------------


@pytest.mark.parametrize("max_la,lookahead", [(1, 1), (3, 2), (3, 3)])
def test_depthtime_scores_and_hints(model, tmp_path, max_la, lookahead):
    rng = np.random.default_rng(150 + max_la + lookahead)
    keys, tensors = depthtime_params(rng, max_la)
    path = write_sidecar(tmp_path / "dt.gguf", "depthtime", keys, tensors, max_lookahead=max_la)
    h = _internal.load_predictor("depthtime", path, model, lookahead)
    assert h.name == "depthtime" and h.lookahead == lookahead
    w = f64(tensors)

    def ref(L, d, hidden, history, prev):
        return depthtime_ref(w, L, d, history, prev)

    check_scores(h, ref, max_la, lookahead, rng, 60)
    check_observe(h, ref, lookahead, rng, 60)


@pytest.fixture(scope="module")
def router_gate(model):
    """gate(hidden, t) -> float64 [E]: layer t's router on rms_norm(hidden) * ffn_norm_t, from the
    tiny model's own tensors (f32, read here with gguf) in float64."""
    r = gguf.GGUFReader(model)
    w = {t.name: np.array(t.data, dtype=np.float64) for t in r.tensors if "ffn_norm" in t.name or "ffn_gate_inp" in t.name}
    arch = str(r.fields["general.architecture"].contents())
    eps = float(r.fields[f"{arch}.attention.layer_norm_rms_epsilon"].contents())

    def gate(hidden, t):
        h = np.asarray(hidden, dtype=np.float64)
        x = h / np.sqrt(np.mean(h * h) + eps) * w[f"blk.{t}.ffn_norm.weight"]
        return w[f"blk.{t}.ffn_gate_inp.weight"].reshape(N_EXPERT, N_EMBD) @ x

    return gate


@pytest.mark.parametrize("max_la,lookahead", [(1, 1), (3, 3)])
def test_depthtime_gate_feature(model, router_gate, tmp_path, max_la, lookahead):
    """depthtime.gate = 1: the stacker also weighs layer t's router applied to the hidden state
    (next_gate's score), with the depth and time features, alone, or not at all."""
    rng = np.random.default_rng(160 + max_la)
    keys, tensors = depthtime_params(rng, max_la, gate=True)
    path = write_sidecar(tmp_path / "dt.gguf", "depthtime", keys, tensors, max_lookahead=max_la)
    h = _internal.load_predictor("depthtime", path, model, lookahead)
    w = f64(tensors)

    def ref(L, d, hidden, history, prev):
        return depthtime_ref(w, L, d, history, prev, gate=router_gate(hidden, L + d))

    check_scores(h, ref, max_la, lookahead, rng, 60)
    check_observe(h, ref, lookahead, rng, 60)


def test_depthtime_time_features_over_a_decode(model, tmp_path):
    """The stateful features: tokens decoded in order (observe at layers 0..n-1 each), some reusing
    an earlier token's route so the votes have something to find, with a new sequence (no previous
    token) part way; numpy recomputes every feature from the list of earlier tokens, and the C++
    scores and hints must follow it."""
    rng = np.random.default_rng(171)
    max_la = lookahead = 3
    keys, tensors = depthtime_params(rng, max_la, history=True)
    path = write_sidecar(tmp_path / "dt.gguf", "depthtime", keys, tensors, max_lookahead=max_la)
    h = _internal.load_predictor("depthtime", path, model, lookahead)
    w = f64(tensors)
    earlier = []
    checked = 0
    for token in range(20):
        if token == 12:  # a new sequence: no previous token
            earlier = []
        prev = earlier[-1] if earlier else np.full((N_LAYER, TOP_K), -1, dtype=np.int32)
        full, _ = random_routing(rng, N_LAYER - 1, False)
        if earlier and rng.random() < 0.5:  # route like an earlier token for the first few layers
            n_copy = rng.integers(1, N_LAYER)
            full[:n_copy] = earlier[rng.integers(len(earlier))][:n_copy]
        hidden = rng.normal(size=N_EMBD).astype(np.float32)
        logits = rng.normal(size=N_EXPERT).astype(np.float32)
        for L in range(N_LAYER):
            history = np.full((N_LAYER, TOP_K), -1, dtype=np.int32)
            history[: L + 1] = full[: L + 1]
            hints = h.observe(L, hidden, logits, history, prev)
            for d in range(1, lookahead + 1):
                if L + d >= N_LAYER:
                    continue
                want = depthtime_ref(w, L, d, history, prev, earlier)
                got = h.scores(L, d, hidden, logits, history, prev)  # reads the state, never updates it
                assert_scores_close(got, want, f"token {token} L={L} d={d}")
                order = sorted(range(N_EXPERT), key=lambda e: (-want[e], e))
                if want[order[TOP_K - 1]] - want[order[TOP_K]] > 1e-3:
                    assert [e for (t, e, _) in hints if t == L + d] == order[:TOP_K], (token, L, d)
                    checked += 1
        earlier.append(full)
    assert checked > 250
    # Scores of an earlier layer after a later one (the overlap cache must start again).
    for L in (5, 2, 7):
        history = np.full((N_LAYER, TOP_K), -1, dtype=np.int32)
        history[: L + 1] = full[: L + 1]
        want = depthtime_ref(w, L, 1, history, earlier[-2], earlier[:-1])
        assert_scores_close(h.scores(L, 1, hidden, logits, history, earlier[-2]), want, f"again L={L}")


def test_depthtime_votes_keep_the_last_window_of_tokens(model, tmp_path):
    """Past DT_WINDOW earlier tokens only the latest vote; the decayed counts and the running
    frequency still cover every token of the sequence."""
    rng = np.random.default_rng(173)
    keys, tensors = depthtime_params(rng, 1, history=True)
    path = write_sidecar(tmp_path / "dt.gguf", "depthtime", keys, tensors, max_lookahead=1)
    h = _internal.load_predictor("depthtime", path, model, 1)
    w = f64(tensors)
    # The oldest tokens all route alike and differently from the later ones, so dropping them moves
    # the votes: experts 0..1 early, later tokens never choose them at layer 0.
    early = np.tile(np.array([0, 1], dtype=np.int32), (N_LAYER, 1))
    earlier = [early] * 40
    for _ in range(DT_WINDOW - 10):
        tok = np.stack([rng.choice(np.arange(2, N_EXPERT), TOP_K, replace=False) for _ in range(N_LAYER)])
        earlier.append(tok.astype(np.int32))
    hidden = rng.normal(size=N_EMBD).astype(np.float32)
    logits = rng.normal(size=N_EXPERT).astype(np.float32)
    blank = np.full((N_LAYER, TOP_K), -1, dtype=np.int32)
    h.observe(0, hidden, logits, blank, blank)  # a new sequence
    for tok in earlier:  # each token seen at layer 0 of the next one
        h.observe(0, hidden, logits, tok, tok)
    assert len(earlier) > DT_WINDOW
    full = early.copy()  # the current token routes like the oldest ones
    for L in (0, 1, 4, 9):  # targets 1, 5: vote1 alone; 2, 10: regp * vote4 alone
        history = np.full((N_LAYER, TOP_K), -1, dtype=np.int32)
        history[: L + 1] = full[: L + 1]
        want = depthtime_ref(w, L, 1, history, earlier[-1], earlier)
        assert_scores_close(h.scores(L, 1, hidden, logits, history, earlier[-1]), want, f"L={L}")
        # The window matters here: with every earlier token voting the scores differ.
        everyone = depthtime_ref(w, L, 1, history, earlier[-1], earlier, window=len(earlier))
        assert np.abs(everyone - want).max() > 1e-2, L


def test_depthtime_prompt_context_is_history(model, tmp_path):
    """observe_context (a batched prompt's tokens but the last) then the next token's observe with
    the last one as prev: the same features as if every prompt token had been decoded; a context
    that starts a new sequence drops what came before, one that does not extends it."""
    rng = np.random.default_rng(177)
    keys, tensors = depthtime_params(rng, 2, history=True)
    h = _internal.load_predictor("depthtime", write_sidecar(tmp_path / "dt.gguf", "depthtime", keys, tensors, max_lookahead=2), model, 2)
    w = f64(tensors)
    hidden = rng.normal(size=N_EMBD).astype(np.float32)
    logits = rng.normal(size=N_EXPERT).astype(np.float32)

    def prompt(n):
        return [random_routing(rng, N_LAYER - 1, False)[0] for _ in range(n)]

    def check(earlier, what):
        full = random_routing(rng, N_LAYER - 1, False)[0]
        full[:4] = earlier[2][:4]  # routes like a prompt token for a while: the votes find it
        for L in range(N_LAYER - 1):
            history = np.full((N_LAYER, TOP_K), -1, dtype=np.int32)
            history[: L + 1] = full[: L + 1]
            h.observe(L, hidden, logits, history, earlier[-1])
            want = depthtime_ref(w, L, 1, history, earlier[-1], earlier)
            assert_scores_close(h.scores(L, 1, hidden, logits, history, earlier[-1]), want, f"{what} L={L}")
        return full

    first = prompt(9)
    h.observe(0, hidden, logits, first[0], first[0])  # stale state the new sequence must drop
    h.observe_context(np.array(first[:-1]), True)
    tok = check(first, "new sequence")
    second = prompt(5)  # a later turn: prompt 1, the decoded token, prompt 2
    h.observe_context(np.array([tok] + second[:-1]), False)
    check(first + [tok] + second, "appended")
    with pytest.raises(_core.InvalidArgument, match="selections has shape"):
        h.observe_context(np.zeros((3, N_LAYER, TOP_K + 1), dtype=np.int32), False)


@pytest.mark.parametrize(
    "gate,pool",
    [(False, False), (True, False), (False, True)],
    ids=["history", "history+gate", "history+pool"],
)
def test_depthtime_reference_matches_the_engine_over_a_trace(model, tmp_path, gate, pool):
    """reference.DepthTimePredictor (vectorised over a whole trace: what training and `predictor
    eval` use) against the C++ predictor fed the same tokens in order, on sequences where tokens
    often follow an earlier token's route, with a one-token sequence and a missing id. With the gate
    feature, the trace carries hidden states and the reference reads the model's routers. With a
    pool, half its tokens follow a trace token's route for a while."""
    from sharpi.predict.reference import DepthTimePredictor, ModelRouters
    from sharpi.predict.sidecar import Sidecar
    from sharpi.predict.traces import load_trace

    rng = np.random.default_rng(175)
    tokens, seq_start = [], []
    for length in (30, 1, 45):
        seq_start.append(len(tokens))
        seq = []
        for _ in range(length):
            full, _ = random_routing(rng, N_LAYER - 1, False)
            if seq and rng.random() < 0.5:
                n_copy = rng.integers(1, N_LAYER)
                full[:n_copy] = seq[rng.integers(len(seq))][:n_copy]
            seq.append(full)
        tokens += seq
    experts = np.array(tokens, dtype=np.int16)
    experts[40, 3, 1] = -1
    hidden = (rng.normal(size=(len(tokens), N_LAYER, N_EMBD)) * 3).astype(np.float16)
    np.savez(tmp_path / "t.npz", experts=experts, seq_start=np.array(seq_start, dtype=np.int64),
             num_experts=np.int64(N_EXPERT), top_k=np.int64(TOP_K), moe_layer_ids=np.arange(N_LAYER, dtype=np.int16),
             hidden=hidden)
    trace = load_trace(str(tmp_path / "t.npz"))
    pooled = None
    if pool:
        routes = random_pool(rng, 150)
        sources, lengths = rng.integers(len(tokens), size=75), rng.integers(1, N_LAYER, size=75)
        for k, (src, n_copy) in enumerate(zip(sources, lengths)):
            routes[k, :n_copy] = experts[src, :n_copy]
        pooled = (routes, 12)
    keys, tensors = depthtime_params(rng, 3, history=True, gate=gate, pool=pooled)
    tensors = {n: np.asarray(a, dtype=np.float32) for n, a in tensors.items()}
    sc = Sidecar("depthtime", N_LAYER, N_EXPERT, TOP_K, 3, "test", keys, tensors)
    reference = DepthTimePredictor(sc, ModelRouters(model) if gate else None)
    reference.check_trace(trace)
    idx = np.arange(trace.n_tokens)
    want = [reference.scores_all(trace, idx, L) for L in range(N_LAYER - 1)]
    h = _internal.load_predictor("depthtime", write_sidecar(tmp_path / "dt.gguf", "depthtime", keys, tensors), model, 3)
    logits = rng.normal(size=N_EXPERT).astype(np.float32)
    for i in idx:
        prev = experts[i - 1].astype(np.int32) if i not in seq_start else np.full((N_LAYER, TOP_K), -1, np.int32)
        for L in range(N_LAYER - 1):
            history = np.full((N_LAYER, TOP_K), -1, dtype=np.int32)
            history[: L + 1] = experts[i, : L + 1]
            h.observe(L, hidden[i, L].astype(np.float32), logits, history, prev)
            for d in range(1, 4):
                if L + d < N_LAYER:
                    got = h.scores(L, d, hidden[i, L].astype(np.float32), logits, history, prev)
                    assert_scores_close(got, want[L][d - 1, i], f"token {i} L={L} d={d}")


def test_depthtime_wrong_shapes(model, tmp_path):
    rng = np.random.default_rng(151)
    keys, tensors = depthtime_params(rng, 2)
    path = write_sidecar(tmp_path / "dt.gguf", "depthtime", keys, tensors, max_lookahead=3)  # stack has 2 rows
    with pytest.raises(_core.FormatError, match=r"'dt.count' has shape \[12, 2, 8, 8\], expected \[12, 3, 8, 8\]"):
        _internal.load_predictor("depthtime", path, model, 1)
    short = dict(tensors, **{"dt.prev": rng.normal(size=(N_LAYER, 2, N_EXPERT, N_EXPERT))})
    path = write_sidecar(tmp_path / "p.gguf", "depthtime", keys, short, max_lookahead=2)
    with pytest.raises(_core.FormatError, match=r"'dt.prev' has shape"):
        _internal.load_predictor("depthtime", path, model, 1)
    # A file of the earlier format (a 4-member mix instead of the stacker) or another feature count.
    old = {n: a for n, a in tensors.items() if n != "dt.stack"} | {"dt.mix": np.zeros((2, N_LAYER, 4))}
    path = write_sidecar(tmp_path / "old.gguf", "depthtime", keys, old, max_lookahead=2)
    with pytest.raises(_core.FormatError, match=r"dt.stack"):
        _internal.load_predictor("depthtime", path, model, 1)
    wide = dict(tensors, **{"dt.stack": np.zeros((2, N_LAYER, DT_FEATURES + 1))})
    path = write_sidecar(tmp_path / "wide.gguf", "depthtime", keys, wide, max_lookahead=2)
    with pytest.raises(_core.FormatError, match=r"'dt.stack' has shape \[2, 12, 34\], expected \[2, 12, 33\]"):
        _internal.load_predictor("depthtime", path, model, 1)
    # The gate feature: the key says how many columns; it is 0 or 1.
    path = write_sidecar(tmp_path / "gate.gguf", "depthtime", {"depthtime.gate": 1}, tensors, max_lookahead=2)
    with pytest.raises(_core.FormatError, match=r"'dt.stack' has shape \[2, 12, 33\], expected \[2, 12, 35\]"):
        _internal.load_predictor("depthtime", path, model, 1)
    path = write_sidecar(tmp_path / "gate2.gguf", "depthtime", {"depthtime.gate": 2}, wide, max_lookahead=2)
    with pytest.raises(_core.FormatError, match=r"depthtime.gate' = 2 is outside \[0, 1\]"):
        _internal.load_predictor("depthtime", path, model, 1)


@pytest.mark.parametrize(
    "max_la,lookahead,n_pool,neighbours,gate",
    [(3, 3, 300, 40, False), (2, 2, 300, 5, True), (1, 1, 120, 400, False), (3, 2, 1, 1, False)],
)
def test_depthtime_pool_scores_and_hints(
    model, router_gate, tmp_path, max_la, lookahead, n_pool, neighbours, gate
):
    """depthtime.pool = N: the 9 pool features (votes of the training tokens whose routes match the
    current token's) with the 33, with and without the gate, M below N and above it (then every pool
    token votes), and a pool of one token."""
    rng = np.random.default_rng(180 + neighbours)
    pool = (random_pool(rng, n_pool), neighbours)
    keys, tensors = depthtime_params(rng, max_la, gate=gate, pool=pool)
    path = write_sidecar(tmp_path / "dt.gguf", "depthtime", keys, tensors, max_lookahead=max_la)
    h = _internal.load_predictor("depthtime", path, model, lookahead)
    w = f64(tensors)

    def ref(L, d, hidden, history, prev):
        g = router_gate(hidden, L + d) if gate else None
        return depthtime_ref(w, L, d, history, prev, gate=g, pool=pool)

    check_scores(h, ref, max_la, lookahead, rng, 60)
    check_observe(h, ref, lookahead, rng, 60)


def test_depthtime_pool_ties_take_the_lower_index(model, tmp_path):
    """Six routes, each shared by 40 pool tokens (interleaved) up to layer 5 and random after: a
    token routing like one of them ties with its 40 at every layer up to 5, and M = 10 of them vote,
    the lowest indices. Past layer 5 their routes differ, so the highest 10 would vote otherwise."""
    rng = np.random.default_rng(190)
    base = random_pool(rng, 6, unknown=0.0)
    routes = random_pool(rng, 240)
    routes[:, :6] = base[np.arange(240) % 6, :6]
    pool = (routes, 10)
    keys, tensors = depthtime_params(rng, 3, pool=pool)
    stack = np.zeros_like(tensors["dt.stack"])
    for d in range(3):
        for t in range(N_LAYER):
            stack[d, t, DT_FEATURES + (d + t) % DT_POOL] = 1.0  # each pool feature alone in turn
    tensors["dt.stack"] = stack
    path = write_sidecar(tmp_path / "dt.gguf", "depthtime", keys, tensors, max_lookahead=3)
    h = _internal.load_predictor("depthtime", path, model, 3)
    w = f64(tensors)
    hidden = rng.normal(size=N_EMBD).astype(np.float32)
    logits = rng.normal(size=N_EXPERT).astype(np.float32)
    apart = []
    for k in range(6):
        full, prev = random_routing(rng, N_LAYER - 1, True)
        full[:6] = base[k, :6]
        for L in range(6):
            history = np.full((N_LAYER, TOP_K), -1, dtype=np.int32)
            history[: L + 1] = full[: L + 1]
            for d in (1, 2, 3):
                want = depthtime_ref(w, L, d, history, prev, pool=pool)
                got = h.scores(L, d, hidden, logits, history, prev)
                assert_scores_close(got, want, f"route {k} L={L} d={d}")
                if L + d >= 6:  # the other tie rule: the pool in reverse order
                    other = depthtime_ref(w, L, d, history, prev, pool=(routes[::-1], 10))
                    apart.append(np.abs(other - want).max() / max(1.0, np.abs(want).max()))
    assert len(apart) == 6 * 6 and min(apart) > 1e-3, sorted(apart)[:3]


def test_depthtime_pool_counts_follow_the_history(model, tmp_path):
    """The match counts are kept between calls while the history extends the rows they were counted
    from: one token through every layer, then tokens interleaved at one layer, layers going down and
    up, a history changed in its last or its first row, observe() and scores() mixed. Every call
    must equal the reference computed from scratch."""
    rng = np.random.default_rng(195)
    routes = random_pool(rng, 200)
    pool = (routes, 16)
    keys, tensors = depthtime_params(rng, 3, pool=pool)
    path = write_sidecar(tmp_path / "dt.gguf", "depthtime", keys, tensors, max_lookahead=3)
    h = _internal.load_predictor("depthtime", path, model, 3)
    w = f64(tensors)
    # Tokens routing like a pool token for their first layers, so the counts single out neighbours.
    tokens = []
    for k in range(3):
        full, _ = random_routing(rng, N_LAYER - 1, False)
        for layer in range(4 + 3 * k):
            if (routes[7 * k, layer] >= 0).all():
                full[layer] = routes[7 * k, layer]
        tokens.append(full)
    _, prev = random_routing(rng, 0, True)
    hidden = rng.normal(size=N_EMBD).astype(np.float32)
    logits = rng.normal(size=N_EXPERT).astype(np.float32)

    def check(L, history, what):
        for d in (1, 2, 3):
            if L + d < N_LAYER:
                want = depthtime_ref(w, L, d, history, prev, pool=pool)
                assert_scores_close(h.scores(L, d, hidden, logits, history, prev), want, f"{what} d={d}")

    order = [(0, L) for L in range(N_LAYER)]
    order += [(1, 4), (2, 4), (0, 4), (0, 2), (0, 3), (0, 9), (1, 9), (1, 0), (2, 11), (2, 5), (2, 6)]
    for step, (k, L) in enumerate(order):
        history = np.full((N_LAYER, TOP_K), -1, dtype=np.int32)
        history[: L + 1] = tokens[k][: L + 1]
        if step % 2:
            h.observe(L, hidden, logits, history, prev)
        check(L, history, f"step {step}: token {k} L={L}")
    for row in (6, 0):
        changed = history.copy()
        changed[row] = (changed[row] + 1) % N_EXPERT
        h.scores(6, 1, hidden, logits, history, prev)  # counted for the unchanged rows first
        check(6, changed, f"row {row} changed")


def test_depthtime_pool_bad_files(model, tmp_path):
    rng = np.random.default_rng(197)
    routes = random_pool(rng, 30)
    keys, tensors = depthtime_params(rng, 2, pool=(routes, 4))

    def load(name, keys, tensors):
        path = write_sidecar(tmp_path / f"{name}.gguf", "depthtime", keys, tensors, max_lookahead=2)
        return _internal.load_predictor("depthtime", path, model, 1)

    load("good", keys, tensors)
    # Every cell an integer in [-1, E).
    for value, shown in [(2.5, "2.500000"), (N_EXPERT, "8.000000"), (-2, "-2.000000"), (np.nan, "-?nan")]:
        bad = routes.astype(np.float32)
        bad[3, 4, 1] = value
        expected = rf"tensor 'dt.pool' holds {shown} at \[3, 4, 1\], expected an expert id in -1..7"
        with pytest.raises(_core.FormatError, match=expected):
            load("value", keys, dict(tensors, **{"dt.pool": bad}))
    # A pool needs neighbours.
    for neighbours in ({}, {"depthtime.neighbours": 0}):
        with pytest.raises(
            _core.FormatError,
            match=r"'sharpi.predictor.depthtime.neighbours' = 0 with depthtime.pool = 30, expected >= 1",
        ):
            load("neighbours", {"depthtime.pool": 30} | neighbours, tensors)
    # The tensor's shape follows the keys; the stack has the 9 columns only with a pool.
    with pytest.raises(_core.FormatError, match=r"'dt.pool' has shape \[30, 12, 1\], expected \[30, 12, 2\]"):
        load("narrow", keys, dict(tensors, **{"dt.pool": routes[:, :, :1]}))
    with pytest.raises(_core.FormatError, match=r"'dt.pool' has shape \[30, 12, 2\], expected \[31, 12, 2\]"):
        load("count", keys | {"depthtime.pool": 31}, tensors)
    with pytest.raises(_core.FormatError, match=r"missing tensor 'dt.pool'"):
        load("missing", keys, {n: a for n, a in tensors.items() if n != "dt.pool"})
    narrow = dict(tensors, **{"dt.stack": tensors["dt.stack"][..., :DT_FEATURES]})
    stack = r"'dt.stack' has shape \[2, 12, {}\], expected \[2, 12, {}\]"
    with pytest.raises(_core.FormatError, match=stack.format(33, 42)):
        load("stack", keys, narrow)
    with pytest.raises(_core.FormatError, match=stack.format(42, 44)):
        load("gate", keys | {"depthtime.gate": 1}, tensors)
    no_pool = {"depthtime.pool": 0, "depthtime.neighbours": 0}
    with pytest.raises(_core.FormatError, match=stack.format(42, 33)):
        load("no_pool", no_pool, tensors)  # dt.pool alone adds no columns
    load("no_pool_33", no_pool, narrow)


# ---- learned -------------------------------------------------------------------------------------


@pytest.mark.parametrize("rank,hidden,max_la,lookahead", [(0, 48, 3, 3), (16, 32, 2, 1), (1, 8, 1, 1)])
def test_learned_scores_and_hints(model, tmp_path, rank, hidden, max_la, lookahead):
    rng = np.random.default_rng(200 + rank)
    keys, tensors = learned_params(rng, hidden, rank, max_la)
    path = write_sidecar(tmp_path / "learned.gguf", "learned", keys, tensors, max_lookahead=max_la)
    h = _internal.load_predictor("learned", path, model, lookahead)
    w = f64(tensors)

    def ref(L, d, hidden_, history, prev):
        return learned_ref(w, keys, L, d, hidden_)

    check_scores(h, ref, max_la, lookahead, rng, 60)
    check_observe(h, ref, lookahead, rng, 60)


def test_learned_sees_a_reused_buffer_change(model, tmp_path):
    """The engine passes the same hidden buffer for every token: a predictor that caches by address
    would return the previous token's scores."""
    rng = np.random.default_rng(7)
    keys, tensors = learned_params(rng, 32, 0, 2)
    path = write_sidecar(tmp_path / "learned.gguf", "learned", keys, tensors, max_lookahead=2)
    h = _internal.load_predictor("learned", path, model, 2)
    w = f64(tensors)
    hidden, logits, history, prev = random_input(rng, 4, False)
    for _ in range(3):
        for d in (1, 2):
            assert_scores_close(
                h.scores(4, d, hidden, logits, history, prev),
                learned_ref(w, keys, 4, d, hidden),
                "same buffer",
            )
        hidden[:] = rng.normal(size=N_EMBD)  # in place: same address, new token


# ---- trajectory ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "W,D,n_block,n_head,F,max_la,lookahead",
    [(10, 32, 2, 4, 64, 3, 3), (4, 16, 1, 1, 24, 2, 2), (1, 24, 3, 2, 40, 1, 1)],
)
def test_trajectory_scores_and_hints(model, tmp_path, W, D, n_block, n_head, F, max_la, lookahead):
    rng = np.random.default_rng(300 + W)
    keys, tensors = trajectory_params(rng, W, D, n_block, n_head, F, max_la)
    path = write_sidecar(tmp_path / "traj.gguf", "trajectory", keys, tensors, max_lookahead=max_la)
    h = _internal.load_predictor("trajectory", path, model, lookahead)
    w = f64(tensors)

    def ref(L, d, hidden, history, prev):
        return trajectory_ref(w, keys, max_la, L, d, history, prev)

    # Every layer appears, so windows shorter than W (L + 1 < W) and full windows are both covered.
    check_scores(h, ref, max_la, lookahead, rng, 48)
    check_observe(h, ref, lookahead, rng, 36)


def test_trajectory_reads_only_what_the_spec_says(model, tmp_path):
    """Rows of history after L and prev rows other than L+1..L+max_lookahead must not matter, and
    a changed history row inside the window must (a cache keyed on too little would miss it)."""
    rng = np.random.default_rng(11)
    keys, tensors = trajectory_params(rng, 3, 16, 2, 2, 32, 2)
    path = write_sidecar(tmp_path / "traj.gguf", "trajectory", keys, tensors, max_lookahead=2)
    h = _internal.load_predictor("trajectory", path, model, 2)
    w = f64(tensors)
    L = 6
    hidden, logits, history, prev = random_input(rng, L, True)
    base = h.scores(L, 1, hidden, logits, history, prev)
    noisy_history, noisy_prev = history.copy(), prev.copy()
    noisy_history[L + 1 :] = rng.integers(0, N_EXPERT, size=noisy_history[L + 1 :].shape)
    noisy_prev[: L + 1] = rng.integers(0, N_EXPERT, size=noisy_prev[: L + 1].shape)
    noisy_prev[L + 3 :] = rng.integers(0, N_EXPERT, size=noisy_prev[L + 3 :].shape)
    np.testing.assert_array_equal(h.scores(L, 1, hidden, logits, noisy_history, noisy_prev), base)
    for s in (L - 2, L):  # oldest and newest window rows
        changed = history.copy()
        changed[s] = [(e + 1) % N_EXPERT for e in changed[s]]
        assert_scores_close(
            h.scores(L, 1, hidden, logits, changed, prev),
            trajectory_ref(w, keys, 2, L, 1, changed, prev),
            f"row {s} changed",
        )
    changed = prev.copy()
    changed[L + 2] = [(e + 3) % N_EXPERT for e in changed[L + 2]]
    assert_scores_close(
        h.scores(L, 1, hidden, logits, history, changed),
        trajectory_ref(w, keys, 2, L, 1, history, changed),
        "prev row L+2 changed",
    )


# ---- bad input -----------------------------------------------------------------------------------


@pytest.fixture()
def valid_cooc(tmp_path):
    rng = np.random.default_rng(5)
    keys, tensors = cooc_params(rng, 2, 2)
    return keys, tensors


def test_wrong_kind_and_architecture(model, tmp_path, valid_cooc):
    keys, tensors = valid_cooc
    path = write_sidecar(tmp_path / "c.gguf", "cooc", keys, tensors, max_lookahead=2)
    with pytest.raises(_core.InvalidArgument, match=r"'cooc' predictor, expected 'learned'"):
        _internal.load_predictor("learned", path, model, 1)
    other = write_sidecar(tmp_path / "a.gguf", "cooc", keys, tensors, max_lookahead=2, arch="llama")
    with pytest.raises(_core.InvalidArgument, match=r"general.architecture is 'llama'"):
        _internal.load_predictor("cooc", other, model, 1)
    with pytest.raises(_core.InvalidArgument, match=r"kind must be"):
        _internal.load_predictor("bogus", path, model, 1)
    with pytest.raises(_core.InvalidArgument, match=r"does not exist"):
        _internal.load_predictor("cooc", str(tmp_path / "nope.gguf"), model, 1)
    with pytest.raises(_core.InvalidArgument, match=r"needs a sidecar file"):
        _internal.load_predictor("cooc", "", model, 1)
    with pytest.raises(_core.InvalidArgument, match=r"not a sidecar"):
        _internal.load_predictor("cooc", model, model, 1)  # a model file is no sidecar


@pytest.mark.parametrize("field,value", [("n_layer", 6), ("n_expert", 16), ("top_k", 4)])
def test_shape_mismatch_names_both_shapes(model, tmp_path, field, value):
    rng = np.random.default_rng(6)
    shape = {"n_layer": N_LAYER, "n_expert": N_EXPERT, "top_k": TOP_K, field: value}
    keys, tensors = cooc_params(rng, 1, 1, n_layer=shape["n_layer"], E=shape["n_expert"])
    path = write_sidecar(tmp_path / "c.gguf", "cooc", keys, tensors, max_lookahead=1, **shape)
    mine = f"n_layer={shape['n_layer']}, n_expert={shape['n_expert']}, top_k={shape['top_k']}"
    theirs = f"n_layer={N_LAYER}, n_expert={N_EXPERT}, top_k={TOP_K}"
    with pytest.raises(_core.InvalidArgument) as err:
        _internal.load_predictor("cooc", path, model, 1)
    assert mine in str(err.value) and theirs in str(err.value) and "tiny.gguf" in str(err.value)


def test_learned_n_embd_mismatch(model, tmp_path):
    rng = np.random.default_rng(8)
    keys, tensors = learned_params(rng, 8, 0, 1, n_embd=32)
    path = write_sidecar(tmp_path / "l.gguf", "learned", keys, tensors, max_lookahead=1)
    with pytest.raises(_core.InvalidArgument, match=r"n_embd=32 but the model has n_embd=64"):
        _internal.load_predictor("learned", path, model, 1)


def test_lookahead_beyond_max_lookahead(model, tmp_path, valid_cooc):
    keys, tensors = valid_cooc
    path = write_sidecar(tmp_path / "c.gguf", "cooc", keys, tensors, max_lookahead=2)
    _internal.load_predictor("cooc", path, model, 2)
    with pytest.raises(_core.InvalidArgument, match=r"max_lookahead=2 .* lookahead is 3"):
        _internal.load_predictor("cooc", path, model, 3)
    with pytest.raises(_core.InvalidArgument, match=r"lookahead must be >= 1"):
        _internal.load_predictor("cooc", path, model, 0)


def test_missing_wrong_shape_and_non_f32_tensors(model, tmp_path):
    rng = np.random.default_rng(9)
    keys, tensors = trajectory_params(rng, 2, 8, 2, 2, 8, 1)
    missing = dict(tensors)
    del missing["traj.blk.1.up.b"]
    path = write_sidecar(tmp_path / "m.gguf", "trajectory", keys, missing, max_lookahead=1)
    with pytest.raises(_core.FormatError, match=r"missing tensor 'traj.blk.1.up.b'"):
        _internal.load_predictor("trajectory", path, model, 1)

    reshaped = dict(tensors)
    reshaped["traj.blk.0.qkv.w"] = rng.normal(size=(8, 24))  # transposed
    path = write_sidecar(tmp_path / "s.gguf", "trajectory", keys, reshaped, max_lookahead=1)
    with pytest.raises(
        _core.FormatError, match=r"'traj.blk.0.qkv.w' has shape \[8, 24\], expected \[24, 8\]"
    ):
        _internal.load_predictor("trajectory", path, model, 1)

    path = write_sidecar(
        tmp_path / "h.gguf",
        "trajectory",
        keys,
        tensors,
        max_lookahead=1,
        dtypes={"traj.head.1.w": np.float16},
    )
    with pytest.raises(_core.FormatError, match=r"'traj.head.1.w' is f16, expected f32"):
        _internal.load_predictor("trajectory", path, model, 1)

    bad_heads = dict(keys, **{"trajectory.n_head": 3})  # 8 % 3 != 0
    path = write_sidecar(tmp_path / "k.gguf", "trajectory", bad_heads, tensors, max_lookahead=1)
    with pytest.raises(_core.FormatError, match=r"not a multiple of trajectory.n_head=3"):
        _internal.load_predictor("trajectory", path, model, 1)

    no_window = {k: v for k, v in keys.items() if k != "trajectory.window"}
    path = write_sidecar(tmp_path / "w.gguf", "trajectory", no_window, tensors, max_lookahead=1)
    with pytest.raises(_core.FormatError, match=r"missing metadata key 'sharpi.predictor.trajectory.window'"):
        _internal.load_predictor("trajectory", path, model, 1)


def test_cooc_wrong_table_shape_and_bad_max_lookahead(model, tmp_path):
    rng = np.random.default_rng(10)
    keys, tensors = cooc_params(rng, 2, 2)  # n_off = 3 ...
    path = write_sidecar(tmp_path / "c.gguf", "cooc", keys, tensors, max_lookahead=3)  # ... but 3 + 2 - 1 = 4
    with pytest.raises(
        _core.FormatError, match=r"'cooc.layer' has shape \[12, 3, 8, 8\], expected \[12, 4, 8, 8\]"
    ):
        _internal.load_predictor("cooc", path, model, 1)
    path = write_sidecar(tmp_path / "d.gguf", "cooc", keys, tensors, max_lookahead=4)
    with pytest.raises(_core.FormatError, match=r"max_lookahead' = 4 is outside \[1, 3\]"):
        _internal.load_predictor("cooc", path, model, 1)


def test_truncated_file(model, tmp_path):
    rng = np.random.default_rng(12)
    keys, tensors = learned_params(rng, 16, 4, 1)
    path = write_sidecar(tmp_path / "l.gguf", "learned", keys, tensors, max_lookahead=1)
    with open(path, "rb") as f:
        data = f.read()
    for cut in (len(data) - 4, len(data) // 2, 200, 10):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(_core.FormatError):
            _internal.load_predictor("learned", str(bad), model, 1)


def test_bad_call_arguments(model, tmp_path, valid_cooc):
    keys, tensors = valid_cooc
    h = _internal.load_predictor(
        "cooc", write_sidecar(tmp_path / "c.gguf", "cooc", keys, tensors, max_lookahead=2), model, 2
    )
    rng = np.random.default_rng(13)
    hidden, logits, history, prev = random_input(rng, 3, True)
    bad = history.copy()
    bad[0, 0] = N_EXPERT
    with pytest.raises(_core.InvalidArgument, match=r"history holds expert id 8"):
        h.observe(3, hidden, logits, bad, prev)
    with pytest.raises(_core.InvalidArgument, match=r"prev has shape \(12, 3\)"):
        h.observe(3, hidden, logits, history, np.zeros((N_LAYER, 3), np.int32))
    with pytest.raises(_core.InvalidArgument, match=r"hidden has shape \(63,\)"):
        h.scores(3, 1, hidden[:63], logits, history, prev)
    with pytest.raises(_core.InvalidArgument, match=r"layer 12 outside"):
        h.observe(N_LAYER, hidden, logits, history, prev)
