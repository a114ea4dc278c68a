"""Gated DeltaNet ops (cpu/ops/gated_delta_net.h) against float64 numpy models written from the
published recurrence (transformers' torch_recurrent_gated_delta_rule and causal_conv1d_update):
the recurrent form, the chunked form for several chunk sizes (including a ragged last chunk and a
chunk of one token), a state carried across calls, both key-head layouts, and the conv1d's rolling
state. The chunked and recurrent forms must agree to 1e-5 (issue 18)."""

import numpy as np
import pytest
from sharpi import _core, _internal

if not hasattr(_internal, "gated_delta_rule"):
    pytest.skip("this build of sharpi has no gated_delta_rule binding", allow_module_level=True)


def _inputs(T, nk, nv, dk, dv, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, nk, dk))
    k = rng.standard_normal((T, nk, dk))
    q /= np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * np.sqrt(dk)
    k /= np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    v = rng.standard_normal((T, nv, dv))
    g = -np.exp(rng.uniform(-3, 1, (T, nv)))  # log decays in about (-2.7, -0.05)
    beta = 1 / (1 + np.exp(-rng.standard_normal((T, nv))))
    state = 0.3 * rng.standard_normal((nv, dk, dv))
    return [a.astype(np.float32) for a in (q, k, v, g, beta, state)]


def reference(q, k, v, g, beta, state, tiled):
    """float64 recurrence: S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q."""
    T, nk, _ = q.shape
    nv = v.shape[1]
    S = state.astype(np.float64).copy()
    out = np.zeros(v.shape)
    for h in range(nv):
        kh = h % nk if tiled else h // (nv // nk)
        for t in range(T):
            S[h] *= np.exp(np.float64(g[t, h]))
            kt, qt = k[t, kh].astype(np.float64), q[t, kh].astype(np.float64)
            delta = beta[t, h] * (v[t, h] - S[h].T @ kt)
            S[h] += np.outer(kt, delta)
            out[t, h] = S[h].T @ qt
    return out, S


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("chunk", [0, 1, 5, 16, 64])
def test_delta_rule_matches_float64_reference(chunk, tiled):
    q, k, v, g, beta, state = _inputs(T=23, nk=2, nv=4, dk=16, dv=8, seed=chunk + 7 * tiled)
    want_out, want_state = reference(q, k, v, g, beta, state, tiled)
    got_state = state.copy()
    got = _internal.gated_delta_rule(q, k, v, g, beta, got_state, chunk_size=chunk, v_heads_tiled=tiled, threads=2)
    scale = np.abs(want_out).max()
    assert np.abs(got - want_out).max() / scale < 1e-5
    assert np.abs(got_state - want_state).max() / np.abs(want_state).max() < 1e-5


def test_chunked_and_recurrent_agree_across_calls():
    """Prefill 40 tokens chunked (chunk 16), then 10 one at a time, vs all 50 recurrent: the state
    handed from the chunked form to the recurrent one is the same state."""
    q, k, v, g, beta, state = _inputs(T=50, nk=2, nv=2, dk=32, dv=32, seed=3)
    s_rec = state.copy()
    rec = _internal.gated_delta_rule(q, k, v, g, beta, s_rec, chunk_size=0)
    s_mix = state.copy()
    parts = [_internal.gated_delta_rule(q[:40], k[:40], v[:40], g[:40], beta[:40], s_mix, chunk_size=16)]
    for t in range(40, 50):
        sl = slice(t, t + 1)
        parts.append(_internal.gated_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], s_mix, chunk_size=0))
    mixed = np.concatenate(parts)
    assert np.abs(mixed - rec).max() / np.abs(rec).max() < 1e-5
    assert np.abs(s_mix - s_rec).max() / np.abs(s_rec).max() < 1e-5


def test_conv1d_rolling_state_matches_numpy():
    rng = np.random.default_rng(5)
    T, C, K = 9, 12, 4
    x = rng.standard_normal((T, C)).astype(np.float32)
    kernel = rng.standard_normal((C, K)).astype(np.float32)
    # Reference: zero history, full causal conv over all T tokens, SiLU.
    xs = np.concatenate([np.zeros((K - 1, C)), x.astype(np.float64)])
    conv = np.stack([(kernel * xs[t : t + K].T).sum(1) for t in range(T)])
    want = conv / (1 + np.exp(-conv))
    # sharpi: 5 tokens, then 1, then 3, carrying the state.
    state = np.zeros((K - 1, C), np.float32)
    got = np.concatenate([_internal.conv1d_silu(x[a:b], kernel, state) for a, b in [(0, 5), (5, 6), (6, 9)]])
    assert np.abs(got - want).max() < 1e-5
    np.testing.assert_array_equal(state, x[-(K - 1) :])


def test_bad_shapes_are_typed_errors():
    q, k, v, g, beta, state = _inputs(T=4, nk=2, nv=4, dk=8, dv=8, seed=1)
    with pytest.raises(_core.InvalidArgument):
        _internal.gated_delta_rule(q, k, v, g, beta, state[:2].copy())
    with pytest.raises(_core.InvalidArgument):
        _internal.gated_delta_rule(q, k, v[:, :3].copy(), g[:, :3].copy(), beta[:, :3].copy(), state[:3].copy())
