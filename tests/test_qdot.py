"""Fast-mode kernels (cpu/quant/qdot.h) against a numpy model of the same arithmetic.

The model is independent of the C++ code: the activation is quantized in numpy (amax / 127,
round half to even, f32), the weight blocks are unpacked to integers in numpy from the raw bytes
(and those integers are checked against the gguf package's `dequantize`, so the unpacking encodes
the real GGUF layouts), the integer dot is taken in int64 and the float combination is replayed
in numpy float32 one operation at a time, in qdot.h's order. Kernels must match that bit for bit on
every ISA, and the float64 value of the same integer sums within the f32 rounding bound.
Inputs are fresh random draws each run (the seed is printed on failure).
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as Q
from sharpi import InvalidArgument, _internal
from test_quant import oracle_dequantize, random_rows

ISAS = _internal.isa_available()
# The 256-element IQ types run the K-quant arithmetic with signed quants (qdot.h).
IQ_K_TYPES = [Q.IQ4_XS, Q.IQ3_S, Q.IQ3_XXS, Q.IQ2_S, Q.IQ2_XS, Q.IQ2_XXS, Q.IQ1_S, Q.IQ1_M]
K_TYPES = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K] + IQ_K_TYPES
B32_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.MXFP4]
FAST_TYPES = K_TYPES + B32_TYPES
FORMAT = {
    **{t: "q8_K" for t in K_TYPES},
    Q.Q4_0: "q8_0",
    Q.Q5_0: "q8_0",
    Q.Q8_0: "q8_0",
    Q.MXFP4: "q8_0",
    Q.IQ4_NL: "q8_0",
    Q.Q4_1: "q8_1",
    Q.Q5_1: "q8_1",
}
F32 = np.float32

Q8_0_DTYPE = np.dtype([("d", "<f2"), ("qs", "i1", 32)])
Q8_1_DTYPE = np.dtype([("d", "<f2"), ("s", "<f2"), ("qs", "i1", 32)])
Q8_K_DTYPE = np.dtype([("d", "<f4"), ("qs", "i1", 256), ("bsums", "<i2", 16)])


@pytest.fixture
def rng(request):
    seed = int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    print(f"seed {seed}")
    return np.random.default_rng(seed)


# ---- numpy model: activation quantizers ----------------------------------------------------------


def np_quantize(fmt, x):
    """Raw bytes of x quantized to `fmt`, as qdot.h specifies."""
    bs = 256 if fmt == "q8_K" else 32
    xb = np.asarray(x, F32).reshape(-1, bs)
    amax = np.abs(xb).max(axis=1)
    d = amax / F32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, F32(127) / amax, F32(0)).astype(F32)
    q = np.rint(xb * inv[:, None]).astype(np.int8)
    if fmt == "q8_K":
        out = np.zeros(len(xb), Q8_K_DTYPE)
        out["bsums"] = q.reshape(-1, 16, 16).astype(np.int64).sum(axis=2)
        out["d"] = d
    elif fmt == "q8_0":
        out = np.zeros(len(xb), Q8_0_DTYPE)
        out["d"] = d.astype(np.float16)
    else:
        out = np.zeros(len(xb), Q8_1_DTYPE)
        out["d"] = d.astype(np.float16)
        out["s"] = (q.astype(np.int64).sum(axis=1).astype(F32) * d).astype(np.float16)
    out["qs"] = q
    return out.view(np.uint8).reshape(-1)


def np_act_blocks(fmt, raw):
    return raw.view({"q8_K": Q8_K_DTYPE, "q8_0": Q8_0_DTYPE, "q8_1": Q8_1_DTYPE}[fmt])


# ---- numpy model: weight blocks as integers ------------------------------------------------------


def f16(raw, off):
    return raw[:, off : off + 2].copy().view(np.float16)[:, 0].astype(F32)


def q4_k_scales(s):
    """[nb, 12] packed -> (sc [nb, 8], m [nb, 8]) six-bit scales and mins."""
    s = s.astype(np.int64)
    sc = np.zeros((len(s), 8), np.int64)
    m = np.zeros((len(s), 8), np.int64)
    for j in range(8):
        if j < 4:
            sc[:, j] = s[:, j] & 63
            m[:, j] = s[:, j + 4] & 63
        else:
            sc[:, j] = (s[:, j + 4] & 0xF) | ((s[:, j - 4] >> 6) << 4)
            m[:, j] = (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4)
    return sc, m


IQ4_VALUES = np.array(quants.IQ4_NL.kvalues, np.int64)


def iq_grid(cls):
    """The gguf package's grid of an IQ type as integers [entries, width]."""
    cls.init_grid()
    return np.asarray(cls.grid).reshape(cls.grid_shape).astype(np.int64)


def sign_bits(byte):
    """+1 / -1 for bits 0..7 of each byte: [...] -> [..., 8]."""
    return 1 - 2 * ((np.asarray(byte, np.int64)[..., None] >> np.arange(8)) & 1)


def ksign_bits(index7):
    return sign_bits(np.frombuffer(quants.IQ2_XXS.ksigns, np.uint8).astype(np.int64)[index7])


def nibbles32(qs):
    """[..., 16] bytes -> [..., 32]: the low nibbles, then the high ones."""
    qs = qs.astype(np.int64)
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def unpack_iq(qtype, data):
    """256-element IQ row -> unpack_k's dict with signed u: w = d * sc * u (d f32, exact)."""
    raw = data.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    nb = len(raw)
    u32 = lambda a: a.copy().view("<u4").astype(np.int64)
    u16 = lambda a: a.copy().view("<u2").astype(np.int64)
    if qtype == Q.IQ4_XS:
        sh, sl = u16(raw[:, 2:4])[:, 0], raw[:, 4:8].astype(np.int64)
        ls = np.stack(
            [((sl[:, i // 2] >> (4 * (i % 2))) & 15) | (((sh >> (2 * i)) & 3) << 4) for i in range(8)], 1
        )
        u = IQ4_VALUES[nibbles32(raw[:, 8:136].reshape(nb, 8, 16))].reshape(nb, 256)
        d, sc = f16(raw, 0), np.repeat(ls - 32, 2, axis=1)
    elif qtype == Q.IQ2_XXS:
        w = u32(raw[:, 2:66]).reshape(nb, 8, 2)
        index = (w[:, :, 0:1] >> (8 * np.arange(4))) & 255
        signs = ksign_bits((w[:, :, 1:2] >> (7 * np.arange(4))) & 127)
        u = (iq_grid(quants.IQ2_XXS)[index] * signs).reshape(nb, 256)
        d, sc = f16(raw, 0) * F32(0.125), np.repeat(2 * (w[:, :, 1] >> 28) + 1, 2, axis=1)
    elif qtype in (Q.IQ2_XS, Q.IQ2_S):
        if qtype == Q.IQ2_XS:
            qs = u16(raw[:, 2:66])
            index, signs, s = qs & 511, ksign_bits(qs >> 9), raw[:, 66:74]
            grid = iq_grid(quants.IQ2_XS)
        else:
            qh = raw[:, 66:74].astype(np.int64)
            k = np.arange(32)
            index = raw[:, 2:34].astype(np.int64) | (((qh[:, k // 4] >> (2 * (k % 4))) & 3) << 8)
            signs, s = sign_bits(raw[:, 34:66]), raw[:, 74:82]
            grid = iq_grid(quants.IQ2_S)
        u = (grid[index] * signs).reshape(nb, 256)
        s = s.astype(np.int64)
        d, sc = f16(raw, 0) * F32(0.125), 2 * np.stack([s & 15, s >> 4], axis=2).reshape(nb, 16) + 1
    elif qtype == Q.IQ3_XXS:
        ss = u32(raw[:, 66:98])
        grid = iq_grid(quants.IQ3_XXS)[raw[:, 2:66].astype(np.int64)].reshape(nb, 8, 32)
        signs = ksign_bits((ss[:, :, None] >> (7 * np.arange(4))) & 127).reshape(nb, 8, 32)
        u = (grid * signs).reshape(nb, 256)
        d, sc = f16(raw, 0) * F32(0.25), np.repeat(2 * (ss >> 28) + 1, 2, axis=1)
    elif qtype == Q.IQ3_S:
        qh, s = raw[:, 66:74].astype(np.int64), raw[:, 106:110].astype(np.int64)
        k = np.arange(64)
        index = raw[:, 2:66].astype(np.int64) | (((qh[:, k // 8] >> (k % 8)) & 1) << 8)
        u = iq_grid(quants.IQ3_S)[index].reshape(nb, 256) * sign_bits(raw[:, 74:106]).reshape(nb, 256)
        ls = np.stack([s & 15, s >> 4], axis=2).reshape(nb, 8)
        d, sc = f16(raw, 0), np.repeat(2 * ls + 1, 2, axis=1)
    elif qtype == Q.IQ1_S:
        qh = u16(raw[:, 34:50])
        index = raw[:, 2:34].astype(np.int64).reshape(nb, 8, 4) | (
            ((qh[:, :, None] >> (3 * np.arange(4))) & 7) << 8
        )
        delta = np.where(qh & 0x8000, -1, 1)[:, :, None, None]
        u = (8 * iq_grid(quants.IQ1_S)[index] + delta).reshape(nb, 256)
        d, sc = f16(raw, 0) * F32(0.125), np.repeat(2 * ((qh >> 12) & 7) + 1, 2, axis=1)
    else:  # IQ1_M
        w = u16(raw[:, 48:56])
        d16 = (w[:, 0] >> 12) | ((w[:, 1] >> 8) & 0xF0) | ((w[:, 2] >> 4) & 0xF00) | (w[:, 3] & 0xF000)
        i = np.arange(16)
        sc = 2 * ((w[:, i // 4] >> (3 * (i % 4))) & 7) + 1
        k = np.arange(32)
        nib = (raw[:, 32:48].astype(np.int64)[:, k // 2] >> (4 * (k % 2))) & 15
        index = raw[:, 0:32].astype(np.int64) | ((nib & 7) << 8)
        u = (8 * iq_grid(quants.IQ1_S)[index] + np.where(nib & 8, -1, 1)[:, :, None]).reshape(nb, 256)
        d = d16.astype(np.uint16).view(np.float16).astype(F32) * F32(0.125)
    zeros = np.zeros((nb, 16), np.int64)
    return {"u": u, "sc": sc, "mn": zeros, "d": d, "dmin": np.zeros(nb, F32), "offset": 0}


def unpack_k(qtype, data):
    """K-quant row -> dict(u [nb, 256], sc [nb, 16], mn [nb, 16], d, dmin, offset) with
    w = d * sc * (u - offset) - dmin * mn per 16-element sub-block."""
    if qtype in IQ_K_TYPES:
        return unpack_iq(qtype, data)
    bs, ts = 256, {Q.Q2_K: 84, Q.Q3_K: 110, Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}[qtype]
    raw = data.reshape(-1, ts)
    nb = len(raw)
    u = np.zeros((nb, bs), np.int64)
    zeros = np.zeros((nb, 16), np.int64)
    if qtype in (Q.Q4_K, Q.Q5_K):
        sc, m = q4_k_scales(raw[:, 4:16])
        qs = raw[:, 16:144] if qtype == Q.Q4_K else raw[:, 48:176]
        qs = qs.astype(np.int64)
        qh = raw[:, 16:48].astype(np.int64) if qtype == Q.Q5_K else None
        for j in range(4):
            lo, hi = qs[:, 32 * j : 32 * j + 32] & 0xF, qs[:, 32 * j : 32 * j + 32] >> 4
            if qh is not None:
                lo = lo | (((qh >> (2 * j)) & 1) << 4)
                hi = hi | (((qh >> (2 * j + 1)) & 1) << 4)
            u[:, 64 * j : 64 * j + 32], u[:, 64 * j + 32 : 64 * j + 64] = lo, hi
        return {
            "u": u,
            "sc": np.repeat(sc, 2, axis=1),
            "mn": np.repeat(m, 2, axis=1),
            "d": f16(raw, 0),
            "dmin": f16(raw, 2),
            "offset": 0,
        }
    if qtype == Q.Q6_K:
        ql, qh = raw[:, 0:128].astype(np.int64), raw[:, 128:192].astype(np.int64)
        for h in range(2):
            for c in range(4):
                l = ql[:, 64 * h + 32 * (c % 2) : 64 * h + 32 * (c % 2) + 32]
                low = l & 0xF if c < 2 else l >> 4
                high = (qh[:, 32 * h : 32 * h + 32] >> (2 * c)) & 3
                u[:, 128 * h + 32 * c : 128 * h + 32 * c + 32] = low | (high << 4)
        sc = raw[:, 192:208].view(np.int8).astype(np.int64)
        return {"u": u, "sc": sc, "mn": zeros, "d": f16(raw, 208), "dmin": np.zeros(nb, F32), "offset": 32}
    if qtype == Q.Q3_K:
        hm, qs, s = (
            raw[:, 0:32].astype(np.int64),
            raw[:, 32:96].astype(np.int64),
            raw[:, 96:108].astype(np.int64),
        )
        sc = np.zeros((nb, 16), np.int64)
        for i in range(16):
            low = (s[:, i] & 0xF) if i < 8 else (s[:, i - 8] >> 4)
            high = (s[:, 8 + i % 4] >> (2 * (i // 4))) & 3
            sc[:, i] = (low | (high << 4)) - 32
        for h in range(2):
            for j in range(4):
                low = (qs[:, 32 * h : 32 * h + 32] >> (2 * j)) & 3
                high = (hm >> (4 * h + j)) & 1
                u[:, 128 * h + 32 * j : 128 * h + 32 * j + 32] = low | (high << 2)
        return {"u": u, "sc": sc, "mn": zeros, "d": f16(raw, 108), "dmin": np.zeros(nb, F32), "offset": 4}
    # Q2_K
    s, qs = raw[:, 0:16].astype(np.int64), raw[:, 16:80].astype(np.int64)
    for h in range(2):
        for j in range(4):
            u[:, 128 * h + 32 * j : 128 * h + 32 * j + 32] = (qs[:, 32 * h : 32 * h + 32] >> (2 * j)) & 3
    return {"u": u, "sc": s & 0xF, "mn": s >> 4, "d": f16(raw, 80), "dmin": f16(raw, 82), "offset": 0}


def unpack_b32(qtype, data):
    """32-element row -> dict(q [nb, 32] ints, d, m) with w = d * q + m (m = 0 for the signed types)."""
    ts = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q5_0: 22, Q.Q5_1: 24, Q.Q8_0: 34, Q.MXFP4: 17, Q.IQ4_NL: 18}[qtype]
    raw = data.reshape(-1, ts)
    nb = len(raw)
    if qtype == Q.MXFP4:
        # OCP MX: d = 2^(e - 127) and the e2m1 values {0, .5, 1, 1.5, 2, 3, 4, 6}; as integers, the
        # doubled values times d / 2.
        e2m1_doubled = np.array([0, 1, 2, 3, 4, 6, 8, 12], np.int64)
        nib = np.concatenate([raw[:, 1:17] & 0xF, raw[:, 1:17] >> 4], axis=1).astype(np.int64)
        q = np.where(nib & 8, -1, 1) * e2m1_doubled[nib & 7]
        d = np.ldexp(np.float32(1), raw[:, 0].astype(np.int32) - 128).astype(F32)
        return {"q": q, "d": d, "m": np.zeros(nb, F32)}
    if qtype == Q.IQ4_NL:
        return {"q": IQ4_VALUES[nibbles32(raw[:, 2:18])], "d": f16(raw, 0), "m": np.zeros(nb, F32)}
    if qtype == Q.Q8_0:
        return {"q": raw[:, 2:34].view(np.int8).astype(np.int64), "d": f16(raw, 0), "m": np.zeros(nb, F32)}
    has_m = qtype in (Q.Q4_1, Q.Q5_1)
    first = 4 if has_m else 2
    qh = None
    if qtype in (Q.Q5_0, Q.Q5_1):
        qh = raw[:, first : first + 4].copy().view("<u4")[:, 0].astype(np.int64)
        first += 4
    qs = raw[:, first : first + 16].astype(np.int64)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=1)
    if qh is not None:
        q = q | (((qh[:, None] >> np.arange(32)) & 1) << 4)
    if not has_m:
        q = q - (16 if qh is not None else 8)
    return {"q": q, "d": f16(raw, 0), "m": f16(raw, 2) if has_m else np.zeros(nb, F32)}


def unpacked_dequant(qtype, data):
    """float64 weights from the integer unpacking (to check it against the gguf package)."""
    if qtype in K_TYPES:
        k = unpack_k(qtype, data)
        sc, mn = np.repeat(k["sc"], 16, axis=1), np.repeat(k["mn"], 16, axis=1)
        w = (
            k["d"][:, None].astype(np.float64) * sc * (k["u"] - k["offset"])
            - k["dmin"][:, None].astype(np.float64) * mn
        )
    else:
        b = unpack_b32(qtype, data)
        w = b["d"][:, None].astype(np.float64) * b["q"] + b["m"][:, None].astype(np.float64)
    return w.reshape(-1)


# ---- numpy model: the dot ----------------------------------------------------------------------------


def model_vec_dot(qtype, data, xq_raw):
    """(f32 result replayed op by op, float64 value of the same integer sums, sum of |terms|)."""
    fmt = FORMAT[qtype]
    xb = np_act_blocks(fmt, xq_raw)
    if qtype in K_TYPES:
        k = unpack_k(qtype, data)
        q = xb["qs"].astype(np.int64)
        bsums = xb["bsums"].astype(np.int64)
        dots = (k["u"] * q).reshape(len(q), 16, 16).sum(axis=2)
        isum = (k["sc"] * dots).sum(axis=1) - k["offset"] * (k["sc"] * bsums).sum(axis=1)
        imin = (k["mn"] * bsums).sum(axis=1)
        has_min = qtype in (Q.Q2_K, Q.Q4_K, Q.Q5_K)
        acc = F32(0)
        for b in range(len(q)):
            acc = F32(acc + F32(F32(xb["d"][b] * k["d"][b]) * F32(isum[b])))
            if has_min:
                acc = F32(acc - F32(F32(xb["d"][b] * k["dmin"][b]) * F32(imin[b])))
        xd = xb["d"].astype(np.float64)
        terms = np.concatenate([xd * k["d"] * isum, -xd * k["dmin"] * imin])
        return acc, float(terms.sum()), float(np.abs(terms).sum())
    bl = unpack_b32(qtype, data)
    q = xb["qs"].astype(np.int64)
    lanes = (bl["q"] * q).reshape(len(q), 8, 4).sum(axis=2)
    xd = xb["d"].astype(F32)
    acc = np.zeros((2, 8), F32)
    for b in range(len(q)):
        dd = F32(bl["d"][b] * xd[b])
        acc[b % 2] = acc[b % 2] + dd * lanes[b].astype(F32)
    a = acc[0] + acc[1]
    r = F32(F32(F32(a[0] + a[4]) + F32(a[2] + a[6])) + F32(F32(a[1] + a[5]) + F32(a[3] + a[7])))
    terms = (bl["d"].astype(np.float64) * xd)[:, None] * lanes
    terms = list(terms.reshape(-1))
    if qtype in (Q.Q4_1, Q.Q5_1):
        s = xb["s"].astype(F32)
        msum = [F32(0), F32(0)]
        for b in range(len(q)):
            msum[b % 2] = F32(msum[b % 2] + F32(bl["m"][b] * s[b]))
        r = F32(r + F32(msum[0] + msum[1]))
        terms += list(bl["m"].astype(np.float64) * s)
    terms = np.array(terms)
    return r, float(terms.sum()), float(np.abs(terms).sum())


def gamma(m):
    u = 2.0**-24
    return m * u / (1 - m * u)


def bits(v):
    return np.asarray(v, F32).view(np.uint32)


def random_activations(rng, n):
    """Activations with a spread of block magnitudes, a zero block, and exact ties for rounding."""
    x = (rng.standard_normal(n) * rng.choice([1e-3, 0.1, 1.0, 30.0], size=n // 32).repeat(32)).astype(F32)
    x[:32] = 0.0  # an all-zero block: d = 0, quants 0
    if n >= 96:
        # amax 127 gives id = 1: x * id lands on .5 ties, which round half to even.
        x[64:96] = np.array([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5] * 4, F32)
    return x


# ---- tests -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", FAST_TYPES, ids=lambda t: t.name)
def test_integer_unpacking_matches_gguf(qtype, rng):
    # The numpy model's integer view of the weights must be the gguf package's dequantization.
    n = 4 * 256
    data = random_rows(qtype, 1, n, rng)
    want = oracle_dequantize(qtype, data, 1, n)[0].astype(np.float64)
    got = unpacked_dequant(qtype, data)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["q8_0", "q8_1", "q8_K"])
def test_quantize_act_bitwise_equals_numpy(fmt, isa, rng):
    for n in (256, 768, 4096):
        x = random_activations(rng, n)
        got = _internal.quantize_act(fmt, x, isa)
        want = np_quantize(fmt, x)
        assert got.dtype == np.uint8 and got.shape == want.shape
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, f"{fmt} {isa} n={n}: first differing bytes at {bad[:8]}"
    # Rounding ties go to even.
    blocks = np_act_blocks(fmt, _internal.quantize_act(fmt, random_activations(rng, 256), isa))
    qs = blocks["qs"].reshape(-1)
    assert list(qs[64:72]) == [127, 0, 2, 2, 0, -2, -2, 4]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", FAST_TYPES, ids=lambda t: t.name)
def test_vec_dot_bitwise_equals_numpy_model(qtype, isa, rng):
    fmt = FORMAT[qtype]
    assert _internal.act_format(int(qtype)) == fmt
    for n in (256, 3 * 256, 16 * 256):
        data = random_rows(qtype, 1, n, rng)
        x = random_activations(rng, n)
        xq = np_quantize(fmt, x)
        got = _internal.vec_dot_tile(int(qtype), data, xq, n, 1, isa)[0]
        want32, exact, scale = model_vec_dot(qtype, data, xq)
        assert bits(got) == bits(want32), f"{qtype.name} {isa} n={n}: {got!r} != model {want32!r}"
        m = 2 * (n // 32) + 8
        assert abs(float(got) - exact) <= gamma(m) * scale, f"{qtype.name} {isa} n={n}: {got} vs {exact}"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", FAST_TYPES, ids=lambda t: t.name)
def test_tile_gives_each_token_its_vec_dot(qtype, isa, rng):
    fmt = FORMAT[qtype]
    n = 5 * 256
    data = random_rows(qtype, 1, n, rng)
    xqs = [np_quantize(fmt, random_activations(rng, n)) for _ in range(8)]
    single = [_internal.vec_dot_tile(int(qtype), data, xq, n, 1, isa)[0] for xq in xqs]
    # The numpy model directly too: the tile kernels (K-quants: the epilogue vectorized over the
    # tile's tokens) are a separate code path from vec_dot.
    model = [model_vec_dot(qtype, data, xq)[0] for xq in xqs]
    np.testing.assert_array_equal(bits(single), bits(model), err_msg=f"{qtype.name} {isa} vec_dot")
    for nt in range(2, 9):
        tile = _internal.vec_dot_tile(int(qtype), data, np.concatenate(xqs[:nt]), n, nt, isa)
        np.testing.assert_array_equal(
            bits(tile), bits(single[:nt]), err_msg=f"{qtype.name} {isa} tile of {nt}"
        )


@pytest.mark.parametrize("qtype", FAST_TYPES, ids=lambda t: t.name)
def test_fast_error_vs_exact_dot_is_quantization_sized(qtype, rng):
    # Sanity of the whole fast dot against float64 math on the dequantized weights: the error is
    # what 8-bit activations allow (each |x - d q| <= d / 2), not a layout bug.
    n = 8 * 256
    data = random_rows(qtype, 1, n, rng)
    x = rng.standard_normal(n).astype(F32)
    w = oracle_dequantize(qtype, data, 1, n)[0].astype(np.float64)
    xq = np_quantize(FORMAT[qtype], x)
    xb = np_act_blocks(FORMAT[qtype], xq)
    d = np.repeat(xb["d"].astype(np.float64), 256 if qtype in K_TYPES else 32)
    bound = float(np.sum(np.abs(w) * d / 2)) * 1.01 + 1e-5 * float(np.abs(w * x).sum())
    if qtype in (Q.Q4_1, Q.Q5_1):  # s is stored as f16: 2^-11 relative on the min term
        m = np.repeat(unpack_b32(qtype, data)["m"].astype(np.float64), 32)
        bound += float(np.sum(np.abs(m * x))) * 2.0**-10
    got = _internal.vec_dot_tile(int(qtype), data, _internal.quantize_act(FORMAT[qtype], x), n, 1)[0]
    assert abs(float(got) - float(w @ x)) <= bound


@pytest.mark.parametrize("qtype", FAST_TYPES, ids=lambda t: t.name)
def test_matmul_fast_equals_vec_dot_and_prefill_equals_decode(qtype, rng):
    n_rows, n = 11, 3 * 256
    data = random_rows(qtype, n_rows, n, rng)
    row_bytes = data.size // n_rows
    x = np.stack([random_activations(rng, n) for _ in range(7)])
    fmt = FORMAT[qtype]
    want = np.array(
        [
            [
                _internal.vec_dot_tile(
                    int(qtype), data[r * row_bytes : (r + 1) * row_bytes], np_quantize(fmt, x[t]), n
                )[0]
                for r in range(n_rows)
            ]
            for t in range(7)
        ],
        F32,
    )
    for threads in (1, 2, 3):
        y7 = _internal.matmul(int(qtype), data, n_rows, n, x, threads=threads, exact=False)
        np.testing.assert_array_equal(bits(y7), bits(want), err_msg=f"T=7 threads={threads}")
        for t in (0, 3, 6):
            y1 = _internal.matmul(int(qtype), data, n_rows, n, x[t : t + 1], threads=threads, exact=False)
            np.testing.assert_array_equal(bits(y1[0]), bits(want[t]), err_msg=f"T=1 token {t}")
    # exact=True is the f32 path: dot_row per row, whatever fast mode would give.
    y_exact = _internal.matmul(int(qtype), data, n_rows, n, x[:1], threads=1, exact=True)
    ref = [_internal.dot(int(qtype), data[r * row_bytes : (r + 1) * row_bytes], x[0]) for r in range(n_rows)]
    np.testing.assert_array_equal(bits(y_exact[0]), bits(ref))


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def test_amx_runs_where_the_cpu_has_it():
    # AMX prefill (qdot.h's AmxKernels) is on exactly where CPUID has AMX-INT8 and AVX-512 VNNI and
    # the kernel (Linux, which lists the flags only when it supports the tile state) grants it;
    # SHARPI_AMX=0 turns it off.
    flags = _cpu_flags()
    expected = sys.platform.startswith("linux") and {"amx_int8", "amx_tile", "avx512_vnni"} <= flags
    assert _internal.amx_available() == expected, sorted(f for f in flags if "amx" in f or "vnni" in f)
    from sharpi.inspect_model import inspect_summary

    shipped = os.path.join(os.path.dirname(_internal.__file__), "models", "stdlib-moe-q8_0.gguf")
    kernels = inspect_summary(shipped)["cpu_kernels"]  # what `sharpi inspect` prints
    assert kernels == {"isa": _internal.active_isa(),
                       "amx_prefill": expected and _internal.active_isa() == "avx512"}, kernels
    off = subprocess.run([sys.executable, "-c", "from sharpi import _internal; print(_internal.amx_available())"],
                         env=dict(os.environ, SHARPI_AMX="0"), capture_output=True, text=True, timeout=60, check=False)
    assert off.stdout.strip() == "False", off.stderr[-2000:]


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_prefill_tiles_give_each_row_and_token_its_vec_dot(qtype, rng):
    # Where the CPU has AMX this is the tile path (16 rows x 16 tokens, partial tiles padded, chunks
    # of 128 tokens, a last token tile under 8 tokens on vec_dot_tile); elsewhere vec_dot_tile's. Either way every (row,
    # token) is the numpy model's vec_dot, bit for bit, whatever the thread count.
    fmt = FORMAT[qtype]
    for n_rows, n, n_tokens in ((37, 2 * 256, 16), (16, 256, 8), (21, 3 * 256, 40), (5, 256, 23), (33, 256, 9),
                                (6, 256, 150)):  # fmt: skip
        data = random_rows(qtype, n_rows, n, rng)
        row_bytes = data.size // n_rows
        x = np.stack([random_activations(rng, n) for _ in range(n_tokens)])
        xq = [np_quantize(fmt, x[t]) for t in range(n_tokens)]
        want = np.array(
            [[model_vec_dot(qtype, data[r * row_bytes : (r + 1) * row_bytes], xq[t])[0] for r in range(n_rows)]
             for t in range(n_tokens)],
            F32,
        )  # fmt: skip
        for threads in (1, 2, 3):
            y = _internal.matmul(int(qtype), data, n_rows, n, x, threads=threads, exact=False)
            np.testing.assert_array_equal(
                bits(y), bits(want), err_msg=f"{qtype.name} rows={n_rows} n={n} T={n_tokens} threads={threads}"
            )


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda t: t.name)
def test_plain_types_keep_f32_activations_in_fast_mode(qtype, rng):
    assert _internal.act_format(int(qtype)) == "f32"
    n_rows, n = 5, 96
    data = random_rows(qtype, n_rows, n, rng)
    x = rng.standard_normal((3, n)).astype(F32)
    fast = _internal.matmul(int(qtype), data, n_rows, n, x, threads=2, exact=False)
    exact = _internal.matmul(int(qtype), data, n_rows, n, x, threads=2, exact=True)
    np.testing.assert_array_equal(bits(fast), bits(exact))
    with pytest.raises(InvalidArgument, match="no integer kernel"):
        _internal.vec_dot_tile(int(qtype), data[: data.size // n_rows], np.zeros(4, np.uint8), n)


def test_bad_arguments(rng):
    data = random_rows(Q.Q4_K, 1, 256, rng)
    with pytest.raises(InvalidArgument, match="unknown activation format"):
        _internal.quantize_act("q8_9", np.zeros(256, F32))
    with pytest.raises(InvalidArgument, match="multiple of 256"):
        _internal.quantize_act("q8_K", np.zeros(100, F32))
    with pytest.raises(InvalidArgument, match="n_tokens"):
        _internal.vec_dot_tile(int(Q.Q4_K), data, np_quantize("q8_K", np.zeros(256, F32)), 256, 9)
    with pytest.raises(InvalidArgument, match="need 292"):
        _internal.vec_dot_tile(int(Q.Q4_K), data, np.zeros(291, np.uint8), 256)


# Each ISA in a child process (the active ISA is fixed per process): matmul in fast mode, T=1 and
# T=6 with 2 threads, equals that ISA's vec_dot on the numpy-quantized rows; on the scalar ISA fast
# mode takes the f32 path (matmul.h: the portable integer kernels are only the reference), so there
# it equals dot_row.
_FAST_MATMUL_PER_ISA = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[2])
    import numpy as np
    from test_qdot import FAST_TYPES, FORMAT, bits, np_quantize, random_activations
    from test_quant import random_rows
    from sharpi import _internal
    isa = sys.argv[1]
    assert _internal.active_isa() == isa, _internal.active_isa()
    rng = np.random.default_rng(int(sys.argv[3]))
    for qtype in FAST_TYPES:
        n_rows, n = 6, 2 * 256
        data = random_rows(qtype, n_rows, n, rng)
        rb = data.size // n_rows
        x = np.stack([random_activations(rng, n) for _ in range(6)])
        y6 = _internal.matmul(int(qtype), data, n_rows, n, x, threads=2, exact=False)
        for t in range(6):
            rows = [data[r * rb:(r + 1) * rb] for r in range(n_rows)]
            if isa == "scalar":
                ref = [_internal.dot(int(qtype), row, x[t], isa) for row in rows]
            else:
                xq = np_quantize(FORMAT[qtype], x[t])
                ref = [_internal.vec_dot_tile(int(qtype), row, xq, n, 1, isa)[0] for row in rows]
            y1 = _internal.matmul(int(qtype), data, n_rows, n, x[t:t + 1], threads=1, exact=False)
            assert np.array_equal(bits(y1[0]), bits(ref)), (qtype.name, t, "T=1")
            assert np.array_equal(bits(y6[t]), bits(ref)), (qtype.name, t, "T=6")
    print("ok")
    """
)


@pytest.mark.parametrize("isa", ISAS)
def test_fast_matmul_each_isa(isa, rng):
    env = dict(os.environ, SHARPI_ISA=isa)
    here = os.path.dirname(os.path.abspath(__file__))
    seed = str(int(rng.integers(1 << 30)))
    proc = subprocess.run(
        [sys.executable, "-c", _FAST_MATMUL_PER_ISA, isa, here, seed],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
