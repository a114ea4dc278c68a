"""A numpy model of fast mode's attention arithmetic (cpu/ops/attention_kernels.h, attention.cpp), operation
for operation in float32, so the kernels can be held to bit-identity instead of a float64 tolerance.

Every f32 operation the kernels perform is reproduced here as one correctly rounded IEEE operation:
- add, multiply, max: numpy float32 arithmetic (IEEE, round to nearest even).
- fma(a, b, c), one rounding: a * b is exact in float64 for float32 a, b (48 significant bits); the sum
  a * b + c is rounded to float64 *to odd* (the nearest float64 s, nudged one ulp towards the exact
  error when s is inexact and even) and then to float32. Rounding to odd with 29 spare bits makes the
  second rounding correct, so this fma is exact: no double-rounding cases are left (a plain
  float32(float64(a * b + c)) would be off by one ulp when the float64 sum lands on a float32 midpoint).
- expf (libm, the merge of blocks only): float64 exp rounded to float32, i.e. correctly rounded; glibc's
  expf is not correctly rounded in every case (0.502 ulp), so multi-block merges may differ by an ulp.

Orders (attention_kernels.h): score = 8 lane fma chains over d = i, i + 8, ... then the tree
((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)) times scale; softmax m = max, p = exp8(s - m) (range
reduction by ln2 in two fmas, degree-7 Horner polynomial by fmas, times 2^n), l = the same 8 lanes (lane
= key index mod 8) and tree; o[d] = fma chain over the keys in order. The merge and the final 1 / l
(attention.cpp merge / finish): m = max, a = expf(M - m), b = expf(m_part - m), L = L * a + l * b,
O = O * a then O += b * o (an fma on SIMD ISAs, multiply then add in the scalar reference, built for
baseline x86-64 without contraction), out = O * f32(1 / L).
"""

import numpy as np

F32 = np.float32
LANES = 8
BLOCK = 256  # kAttentionBlock


def fma(a, b, c):
    """float32 fma(a, b, c) with one rounding (round to odd in float64, then to float32)."""
    a, b, c = (np.asarray(x, F32).astype(np.float64) for x in (a, b, c))
    ab = a * b  # exact
    s = ab + c
    # TwoSum: ab + c == s + err exactly (finite inputs).
    bb = s - ab
    err = (ab - (s - bb)) + (c - bb)
    bits = s.view(np.int64)
    inexact_even = (err != 0) & ((bits & 1) == 0) & np.isfinite(s)
    toward = np.where(err > 0, np.inf, -np.inf)
    s = np.where(inexact_even, np.nextafter(s, toward), s)
    return s.astype(F32)


def lane_tree(x):
    """((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)) over the last axis (length 8), in float32."""
    x = x.astype(F32)
    return ((x[..., 0] + x[..., 1]) + (x[..., 2] + x[..., 3])) + ((x[..., 4] + x[..., 5]) + (x[..., 6] + x[..., 7]))


def scores(q, k, scale):
    """q [..., R, hd], k [..., n, hd] -> s [..., R, n]: the kernels' 8-lane fma chains, tree, times scale."""
    hd = q.shape[-1]
    assert hd % LANES == 0
    lanes = np.zeros(q.shape[:-1] + (k.shape[-2], LANES), F32)
    for d in range(0, hd, LANES):
        qd = q[..., :, None, d : d + LANES]
        kd = k[..., None, :, d : d + LANES]
        lanes = fma(qd, kd, lanes)
    return lane_tree(lanes) * F32(scale)


EXP_MIN = F32(-87.3365)
LOG2E = F32(1.44269504)
LN2_HI = F32(0.693359375)
LN2_LO = F32(-2.12194440e-4)
POLY = [F32(1.0 / 720.0), F32(1.0 / 120.0), F32(1.0 / 24.0), F32(1.0 / 6.0), F32(0.5), F32(1.0), F32(1.0)]


def exp8(x):
    """The kernels' e^x for x <= 0 (or -inf), elementwise in float32."""
    x = np.asarray(x, F32)
    under = x < EXP_MIN
    xc = np.where(under, EXP_MIN, x).astype(F32)
    n = np.rint(xc * LOG2E).astype(F32)  # round half to even, as nearbyint / _mm256_round_ps
    r = fma(-n, LN2_HI, xc)
    r = fma(-n, LN2_LO, r)
    p = np.full(x.shape, F32(1.0 / 5040.0), F32)
    for c in POLY:
        p = fma(p, r, c)
    two_n = ((n.astype(np.int32) + 127) << 23).astype(np.uint32).view(F32)
    return np.where(under, F32(0), p * two_n).astype(F32)


def block_partial(q, k, v, reads, scale):
    """One block's partials: q [R, hd], k / v [n, hd] f32 (n <= 256, rows relative to the block's first,
    which sits at a multiple of 8), reads [R, n] bool (a contiguous range per row, at least one key).
    Returns (m [R], l [R], o [R, hd]) as the kernels compute them."""
    s = scores(q, k, scale)
    m = np.where(reads, s, F32(-np.inf)).max(axis=1).astype(F32)
    p = np.where(reads, exp8(np.where(reads, s - m[:, None], F32(-np.inf))), F32(0)).astype(F32)
    n = k.shape[0]
    lanes = np.zeros((q.shape[0], LANES), F32)
    for j in range(n):  # lane j % 8 gets key j's p in key order; unread keys add +0 exactly
        lanes[:, j % LANES] = lanes[:, j % LANES] + p[:, j]
    l = lane_tree(lanes)
    o = np.zeros(q.shape, F32)
    for j in range(n):
        o = fma(p[:, j : j + 1], v[j][None, :], o)
    return m, l, o


def attention(q, k, v, pos0, n_head, n_head_kv, head_dim, scale, simd, window=0, sinks=None):
    """Fast-mode causal attention as attention.cpp computes it: q [T, n_head * hd] f32, k / v [n_kv,
    n_head_kv * hd] f32 (the stored rows as the row kernels decode them), blocks of 256 keys, each (token,
    head) merging its blocks' partials in order. simd: whether merge's axpy is an fma (AVX2 / AVX-512)."""
    T = q.shape[0]
    group = n_head // n_head_kv
    hd = head_dim
    qh = q.reshape(T, n_head, hd)
    pos = pos0 + np.arange(T)
    first = np.maximum(0, pos + 1 - window) if window > 0 else np.zeros(T, np.int64)
    acc_m = np.full((T, n_head), F32(-np.inf)) if sinks is None else np.tile(np.asarray(sinks, F32), (T, 1))
    acc_l = np.full((T, n_head), F32(0 if sinks is None else 1), F32)
    acc_o = np.zeros((T, n_head, hd), F32)
    n_kv = pos0 + T
    for j0 in range(0, n_kv, BLOCK):
        j1 = min(j0 + BLOCK, n_kv)
        keys = np.arange(j0, j1)
        reads_t = (keys[None, :] >= first[:, None]) & (keys[None, :] <= pos[:, None])  # [T, n]
        for g in range(n_head_kv):
            kg = k[j0:j1, g * hd : (g + 1) * hd]
            vg = v[j0:j1, g * hd : (g + 1) * hd]
            heads = range(g * group, (g + 1) * group)
            rows = [(t, h) for t in range(T) if reads_t[t].any() for h in heads]
            if not rows:
                continue
            ts = np.array([t for t, _ in rows])
            hs = np.array([h for _, h in rows])
            m, l, o = block_partial(qh[ts, hs], kg, vg, reads_t[ts], scale)
            # merge (attention.cpp)
            M = np.maximum(acc_m[ts, hs], m)
            with np.errstate(invalid="ignore"):
                a = expf(acc_m[ts, hs] - M)
            b = expf(m - M)
            acc_l[ts, hs] = acc_l[ts, hs] * a + l * b
            O = acc_o[ts, hs] * a[:, None]
            acc_o[ts, hs] = fma(b[:, None], o, O) if simd else O + b[:, None] * o
            acc_m[ts, hs] = M
    inv = (F32(1) / acc_l).astype(F32)
    return (acc_o * inv[:, :, None]).reshape(T, n_head * hd)


def expf(x):
    """Correctly rounded float32 e^x (libm's expf up to its rare last-ulp misses); expf(-inf) = 0."""
    x = np.asarray(x, F32)
    with np.errstate(over="ignore"):
        return np.exp(x.astype(np.float64)).astype(F32)
