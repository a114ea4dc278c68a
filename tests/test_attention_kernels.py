"""Fast mode's attention block kernels (cpu/ops/attention_kernels.h) against float64 numpy models, on
fresh random inputs every run (the seed is in each failure message).

Three oracles, tightest first:
- exp: with q a unit vector and one-hot V rows the kernels' p of each key comes out in o untouched
  (one exact product per score, one p per output element), so exp8 is checked alone against float64
  exp: within 3e-7 relative (2.5 ulp), 0 exactly below ln(FLT_MIN).
- scalar reference == every SIMD table, bit for bit (the kernels do the same IEEE operations).
- the block partial (m, l, o) against a float64 model of the same softmax. f32 scores of 128 products
  carry ~1e-7 relative rounding that exp turns into p errors, so o lands ~1e-7..1.2e-6 from float64
  (measured over hundreds of draws); 4e-6 is the budget.
- the tight check: the block partial and whole fast-mode attention against a numpy model of the *same*
  f32 arithmetic (tests/attention_f32_model.py: the kernels' lane fma chains and trees, exp8's range
  reduction and polynomial, the p . v order, the block merge). The block kernels are bit-identical to it;
  whole attention too, except where it merges several blocks with libm's expf, which misses correct
  rounding in ~0.07% of arguments (measured on 2e5 draws): there <= 1e-6 of the row's largest |o|
  (measured: 1.1e-7 at most over 1,200 draws, tests/test_kv_cache.py).
Whole attention against float64 in fast and exact mode is tests/test_kv_cache.py.
"""

import attention_f32_model as f32_model
import numpy as np
import pytest
from sharpi import _core, _internal

ISAS = _internal.isa_available()


def fresh_rng():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    return np.random.default_rng(seed), seed


def block_model(q, k, v, lo, hi, scale):
    """Unnormalised partial softmax per row in float64: m = max s, p = exp(s - m), l = sum p, o = p @ v."""
    m, l, o = [], [], []
    for r in range(q.shape[0]):
        s = k[lo[r]:hi[r]].astype(np.float64) @ q[r].astype(np.float64) * np.float64(np.float32(scale))
        p = np.exp(s - s.max())
        m.append(s.max())
        l.append(p.sum())
        o.append(p @ v[lo[r]:hi[r]].astype(np.float64))
    return np.array(m), np.array(l), np.array(o)


def random_block(rng, n_rows, n_keys, hd):
    q = rng.standard_normal((n_rows, hd)).astype(np.float32)
    k = (rng.standard_normal((n_keys, hd)) * 2).astype(np.float32)
    v = rng.standard_normal((n_keys, hd)).astype(np.float32)
    lo = rng.integers(0, n_keys, n_rows)
    hi = np.array([rng.integers(a + 1, n_keys + 1) for a in lo])
    lo[0], hi[0] = 0, n_keys  # one row over the whole block
    return q, k, v, lo.astype(np.int64), hi.astype(np.int64)


@pytest.mark.parametrize("isa", ISAS)
def test_exp_matches_float64(isa):
    rng, seed = fresh_rng()
    hd = n_keys = 128
    x = np.concatenate([[0.0], -rng.exponential(8.0, 100), -rng.uniform(80, 95, 20), [-1e30] * 7]).astype(np.float32)
    q = np.zeros((1, hd), np.float32)
    q[0, 0] = 1.0
    k = np.zeros((n_keys, hd), np.float32)
    k[:, 0] = x  # score j = x_j exactly
    v = np.eye(n_keys, hd, dtype=np.float32)  # o[j] = p_j exactly
    m, l, o = _internal.attention_block_kernels(isa, q, k, v, np.array([0]), np.array([n_keys]), 1.0)
    assert m[0] == 0.0
    arg = (x - np.float32(m[0])).astype(np.float64)  # the kernel's s - m, in f32
    want = np.where(arg < -87.3365, 0.0, np.exp(arg))
    normal = want > 0
    rel = np.abs(o[0][normal] - want[normal]) / want[normal]
    assert rel.max() <= 3e-7, (seed, rel.max(), x[normal][rel.argmax()])
    np.testing.assert_array_equal(o[0][~normal], 0.0, err_msg=f"seed {seed}")
    assert abs(l[0] - want.sum()) <= 1e-6 * want.sum(), seed


@pytest.mark.parametrize("hd", [32, 64, 128, 136])
def test_simd_equals_scalar_reference(hd):
    rng, seed = fresh_rng()
    for n_rows in (1, 2, 3, 4, 7, 8, 32):  # 4 and 8: pv tiles 2 + 2 and 3 + 3 + 2
        q, k, v, lo, hi = random_block(rng, n_rows, int(rng.integers(1, 257)), hd)
        ref = _internal.attention_block_kernels("scalar", q, k, v, lo, hi, 0.1)
        for isa in ISAS:
            got = _internal.attention_block_kernels(isa, q, k, v, lo, hi, 0.1)
            for a, b in zip(got, ref):
                np.testing.assert_array_equal(a, b, err_msg=f"isa {isa} rows {n_rows} hd {hd} seed {seed}")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("hd", [64, 128])
def test_block_partial_matches_float64_model(isa, hd):
    rng, seed = fresh_rng()
    for n_rows in (1, 5, 32):
        q, k, v, lo, hi = random_block(rng, n_rows, 256, hd)
        scale = 1.0 / np.sqrt(hd)
        m, l, o = _internal.attention_block_kernels(isa, q, k, v, lo, hi, scale)
        wm, wl, wo = block_model(q, k, v, lo, hi, scale)
        assert np.abs(m - wm).max() <= 1e-6 * np.abs(wm).max(), seed
        assert (np.abs(l - wl) / wl).max() <= 4e-6, seed
        rel = np.abs(o - wo).max(axis=1) / np.abs(wo).max(axis=1)
        assert rel.max() <= 4e-6, (seed, rel.max())


def test_rows_read_only_their_range():
    # Rows sharing a call with wider rows get the bits they get alone (keys outside a row's range add
    # p = 0 exactly): what makes prefill tiles equal token-by-token decoding.
    rng, seed = fresh_rng()
    q, k, v, lo, hi = random_block(rng, 9, 256, 64)
    together = _internal.attention_block_kernels(ISAS[-1], q, k, v, lo, hi, 0.125)
    for r in range(9):
        alone = _internal.attention_block_kernels(ISAS[-1], q[r : r + 1], k, v, lo[r : r + 1], hi[r : r + 1], 0.125)
        for a, b in zip(alone, together):
            np.testing.assert_array_equal(a[0], b[r], err_msg=f"row {r} seed {seed}")


def test_bad_ranges_are_rejected():
    q = np.zeros((1, 64), np.float32)
    kv = np.zeros((10, 64), np.float32)
    with pytest.raises(_core.InvalidArgument, match="lo < hi"):
        _internal.attention_block_kernels("scalar", q, kv, kv, np.array([3]), np.array([3]), 1.0)
    with pytest.raises(_core.InvalidArgument, match="multiple of 8"):
        _internal.attention_block_kernels("scalar", np.zeros((1, 60), np.float32), kv[:, :60], kv[:, :60],
                                      np.array([0]), np.array([1]), 1.0)


def reads_of(lo, hi, n_keys):
    keys = np.arange(n_keys)[None, :]
    return (keys >= lo[:, None]) & (keys < hi[:, None])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("hd", [8, 64, 128, 136])
def test_block_partial_is_bit_identical_to_f32_model(isa, hd):
    # Measured: 0 differing elements in m, l and o over 2,000 blocks per ISA (scalar, avx2; hd 8..136,
    # 1..64 rows, 1..256 keys, scales 0.1..3 so that some p underflow to 0), so the assertion is bit-identity.
    rng, seed = fresh_rng()
    for n_rows in (1, 64, int(rng.integers(2, 64))):
        q, k, v, lo, hi = random_block(rng, n_rows, int(rng.integers(1, 257)), hd)
        scale = float(rng.choice([0.1, 1.0 / np.sqrt(hd), 3.0]))
        got = _internal.attention_block_kernels(isa, q, k, v, lo, hi, scale)
        want = f32_model.block_partial(q, k, v, reads_of(lo, hi, k.shape[0]), scale)
        for name, a, b in zip("mlo", got, want):
            np.testing.assert_array_equal(a, b, err_msg=f"{name}: isa {isa} rows {n_rows} hd {hd} seed {seed}")


def test_f32_model_fma_rounds_once():
    # a * b = 1 + 2^-11 + 2^-24 is a float32 midpoint; adding c = +-2^-60 must round away from it (one
    # rounding). Summing in float64 first would land on the midpoint and round to even (1 + 2^-11) both times.
    a = np.float32(1 + 2**-12)
    up = f32_model.fma(a, a, np.float32(2**-60))
    down = f32_model.fma(a, a, np.float32(-(2**-60)))
    assert up == np.float32(1 + 2**-11 + 2**-23)
    assert down == np.float32(1 + 2**-11)
    assert np.float32(np.float64(a) * np.float64(a) + 2**-60) == down  # the double rounding avoided
