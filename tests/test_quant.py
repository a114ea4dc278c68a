"""Quantized CPU kernels (cpu/quant, cpu/ops/matmul) against independent oracles, in exact mode
(f32 activations; the fast mode's integer kernels are tested in test_qdot.py).

Oracles: the gguf package's numpy `gguf.quants.dequantize` for dequantization, float64 numpy for
dot products and matmul. Every case runs on every ISA this CPU has (scalar, avx2, avx512).

Inputs are fresh seeded random blocks: random bytes with the f16 scale fields overwritten by sane
values (|d| in [1e-3, 1e-1], random sign) so that nothing decodes to NaN or inf, plus blocks made
by `gguf.quants.quantize` from real floats for Q8_0 and Q4_0.
"""

import os
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from sharpi import InvalidArgument, UnsupportedError, _internal

ISAS = _internal.isa_available()

# Byte offsets of the f16 scale fields in each block layout (cpp/src/quant/blocks.h).
F16_FIELDS = {
    Q.Q4_0: [0],  # d
    Q.Q4_1: [0, 2],  # d, m
    Q.Q5_0: [0],
    Q.Q5_1: [0, 2],
    Q.Q8_0: [0],
    Q.Q2_K: [80, 82],  # after scales[16] and qs[64]: d, dmin
    Q.Q3_K: [108],  # after hmask[32], qs[64], scales[12]: d
    Q.Q4_K: [0, 2],  # d, dmin
    Q.Q5_K: [0, 2],
    Q.Q6_K: [208],  # after ql[128], qh[64], scales[16]: d
    Q.MXFP4: [],  # no f16 field: one E8M0 exponent byte at 0, kept sane in random_rows
    # The IQ types: d first, except IQ1_M, whose d is spread over four nibbles (random_rows).
    Q.IQ4_NL: [0],
    Q.IQ4_XS: [0],
    Q.IQ3_S: [0],
    Q.IQ3_XXS: [0],
    Q.IQ2_S: [0],
    Q.IQ2_XS: [0],
    Q.IQ2_XXS: [0],
    Q.IQ1_S: [0],
    Q.IQ1_M: [],
}
QUANT_TYPES = list(F16_FIELDS)
PLAIN_TYPES = [Q.F32, Q.F16, Q.BF16]
ALL_TYPES = PLAIN_TYPES + QUANT_TYPES

# Row lengths. Quantized rows: block counts chosen to hit the SIMD paths' edge cases (an odd
# count of 32-element blocks leaves a half group for AVX-512). Plain rows: lengths that are not
# multiples of 8 or 16 exercise the masked tails.
QUANT_BLOCK_COUNTS = [1, 3, 8]
PLAIN_LENGTHS = [1, 7, 16, 37, 100, 515]


def block_size(qtype):
    return gguf.GGML_QUANT_SIZES[qtype][0]


def row_lengths(qtype):
    if qtype in PLAIN_TYPES:
        return PLAIN_LENGTHS
    return [k * block_size(qtype) for k in QUANT_BLOCK_COUNTS]


def random_scales(rng, count):
    """Sane f16 scales: |d| in [1e-3, 1e-1] with a random sign."""
    d = rng.uniform(1e-3, 1e-1, size=count) * rng.choice([-1.0, 1.0], size=count)
    return d.astype(np.float16)


def random_rows(qtype, n_rows, n, rng):
    """Raw bytes of n_rows rows of n elements of qtype, as a 1-D uint8 array."""
    if qtype == Q.F32:
        return rng.standard_normal(n_rows * n).astype(np.float32).view(np.uint8)
    if qtype == Q.F16:
        return rng.standard_normal(n_rows * n).astype(np.float16).view(np.uint8)
    if qtype == Q.BF16:
        f32 = rng.standard_normal(n_rows * n).astype(np.float32)
        return (f32.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = n_rows * n // bs
    raw = rng.integers(0, 256, size=(n_blocks, ts), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        raw[:, off : off + 2] = random_scales(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    if qtype == Q.MXFP4:
        raw[:, 0] = rng.integers(112, 132, size=n_blocks)  # 2^(e - 128): 2^-16 .. 2^3
    if qtype == Q.IQ1_M:
        # d's 16 bits are the top nibbles of the four uint16 scale words (bytes 48..55), low bits first.
        d = random_scales(rng, n_blocks).view(np.uint16)
        words = raw[:, 48:56].copy().view(np.uint16)
        for i in range(4):
            words[:, i] = (words[:, i] & 0x0FFF) | (((d >> (4 * i)) & 0xF) << 12)
        raw[:, 48:56] = words.view(np.uint8)
    return raw.reshape(-1)


def oracle_dequantize(qtype, data, n_rows, n):
    """float32 [n_rows, n] from the gguf package."""
    return gguf_dequantize(data.reshape(n_rows, -1), qtype).astype(np.float32, copy=False).reshape(n_rows, n)


def dot_budget(n):
    """Bound on |dot - exact| / sum|w_i x_i| for a row of n.

    The dequantized weights are exact (test_dequantize_matches_gguf), so the only error is f32
    rounding of the products and sums. The longest accumulation chain is the scalar layout's:
    n / 8 products per lane, then a 3-level tree, plus one rounding per product; the classic
    bound gamma_m = m u / (1 - m u) with u = 2^-24 covers every ISA (the SIMD chains are shorter).
    """
    m = n // 8 + 4
    u = 2.0**-24
    return m * u / (1 - m * u)


# Per-type factor on dot_budget: 1 for every type, because activations are never quantized and no
# type adds error of its own beyond f32 summation (unlike llama.cpp's q8 activation path).
DOT_BUDGET_FACTOR = {t: 1.0 for t in ALL_TYPES}


def bits(a):
    return np.asarray(a, dtype=np.float32).view(np.uint32)


# ---- (a) dequantize == gguf.quants.dequantize ----------------------------------------------------


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf(qtype, isa):
    # Tolerance: none. Every kernel evaluates the gguf package's formula with the same f32 roundings
    # in the same order (e.g. Q4_K: (d*sc)*q rounded, then minus dmin*m rounded), so the values must
    # be bit-identical; a tolerance would hide a changed rounding order or an FMA contraction.
    rng = np.random.default_rng([int(qtype), len(isa)])
    for n in row_lengths(qtype):
        data = random_rows(qtype, 1, n, rng)
        got = _internal.dequantize(int(qtype), data, n, isa)
        want = oracle_dequantize(qtype, data, 1, n)[0]
        assert got.shape == (n,) and got.dtype == np.float32
        mismatch = np.flatnonzero(bits(got) != bits(want))
        assert mismatch.size == 0, f"{qtype.name} n={n} isa={isa}: first bad element {mismatch[:5]}"


@pytest.mark.parametrize("isa", ISAS)
def test_dequantize_half_special_values(isa):
    # Subnormal, zero, signed zero and infinite halves and bfloat16s widen exactly.
    halves = np.array(
        [0x0000, 0x8000, 0x0001, 0x03FF, 0x8001, 0x0400, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00], np.uint16
    )
    halves = np.concatenate([halves, np.arange(0, 0x7C00, 97, dtype=np.uint16)])
    got = _internal.dequantize(int(Q.F16), halves.view(np.uint8), halves.size, isa)
    np.testing.assert_array_equal(bits(got), bits(halves.view(np.float16).astype(np.float32)))
    got = _internal.dequantize(int(Q.BF16), halves.view(np.uint8), halves.size, isa)
    np.testing.assert_array_equal(bits(got), halves.astype(np.uint32) << 16)


# ---- (b) dot vs float64, SIMD vs scalar ------------------------------------------------------------


@pytest.mark.parametrize("isa", ISAS)
def test_dequantize_mxfp4_every_exponent(isa):
    # Every E8M0 byte, the f32-subnormal scales (e < 2) and the overflow to inf (e = 255) included,
    # with every nibble value: bit-identical to the gguf package.
    rng = np.random.default_rng(17)
    raw = rng.integers(0, 256, size=(256, 17), dtype=np.uint8)
    raw[:, 0] = np.arange(256)
    raw[:16, 1:] = (np.arange(16, dtype=np.uint8) * 0x11)[:, None]
    data = raw.reshape(-1)
    with np.errstate(over="ignore"):  # e = 255 times 12 overflows to inf, in numpy as in ggml
        want = oracle_dequantize(Q.MXFP4, data, 1, 256 * 32)[0]
    got = _internal.dequantize(int(Q.MXFP4), data, 256 * 32, isa)
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dot_matches_float64(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    for n in row_lengths(qtype) + ([4096] if qtype in PLAIN_TYPES else [16 * block_size(qtype)]):
        data = random_rows(qtype, 1, n, rng)
        x = rng.standard_normal(n).astype(np.float32)
        w64 = oracle_dequantize(qtype, data, 1, n)[0].astype(np.float64)
        exact = float(np.dot(w64, x.astype(np.float64)))
        scale = float(np.abs(w64 * x).sum())
        budget = DOT_BUDGET_FACTOR[qtype] * dot_budget(n) * scale
        results = {isa: _internal.dot(int(qtype), data, x, isa) for isa in ISAS}
        for isa, got in results.items():
            assert abs(got - exact) <= budget, (
                f"{qtype.name} n={n} {isa}: {got} vs {exact} (budget {budget:.3g})"
            )
            # SIMD vs the scalar reference: both within budget of the exact value.
            assert abs(got - results["scalar"]) <= 2 * budget, f"{qtype.name} n={n} {isa} vs scalar"


# ---- (c) the bitwise invariant: dot_row == dot_f32(dequant_row) for one ISA ---------------------------


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dot_row_bitwise_equals_dot_f32_of_dequantized(qtype, isa):
    rng = np.random.default_rng([200 + int(qtype), len(isa)])
    for n in row_lengths(qtype) + [16 * block_size(qtype)]:
        data = random_rows(qtype, 1, n, rng)
        x = rng.standard_normal(n).astype(np.float32)
        w = _internal.dequantize(int(qtype), data, n, isa)
        via_f32 = _internal.dot(int(Q.F32), w.view(np.uint8), x, isa)  # F32's dot_row is dot_f32
        direct = _internal.dot(int(qtype), data, x, isa)
        assert bits(direct) == bits(via_f32), f"{qtype.name} n={n} {isa}: {direct!r} != {via_f32!r}"


# ---- (d) matmul -----------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_matches_float64_and_decode_equals_prefill(qtype):
    rng = np.random.default_rng(300 + int(qtype))
    n_rows = 13
    n = 8 * block_size(qtype) if qtype in QUANT_TYPES else 100
    data = random_rows(qtype, n_rows, n, rng)
    w64 = oracle_dequantize(qtype, data, n_rows, n).astype(np.float64)
    x = rng.standard_normal((5, n)).astype(np.float32)
    exact = x.astype(np.float64) @ w64.T
    budget = DOT_BUDGET_FACTOR[qtype] * dot_budget(n) * (np.abs(x.astype(np.float64)) @ np.abs(w64).T)
    row_bytes = data.size // n_rows
    # What dot_row gives for each (token, row) with the active ISA: matmul must reproduce it exactly.
    per_row = np.array(
        [
            [_internal.dot(int(qtype), data[r * row_bytes : (r + 1) * row_bytes], x[t]) for r in range(n_rows)]
            for t in range(5)
        ],
        dtype=np.float32,
    )
    for threads in (1, 2, 3):
        y5 = _internal.matmul(int(qtype), data, n_rows, n, x, threads=threads, exact=True)
        assert y5.shape == (5, n_rows) and y5.dtype == np.float32
        assert np.all(np.abs(y5 - exact) <= budget), f"{qtype.name} threads={threads}"
        for t in range(5):
            y1 = _internal.matmul(int(qtype), data, n_rows, n, x[t : t + 1], threads=threads, exact=True)
            np.testing.assert_array_equal(bits(y1[0]), bits(y5[t]), err_msg=f"T=1 vs T=5, token {t}")
        np.testing.assert_array_equal(
            bits(y5), bits(per_row), err_msg=f"matmul vs dot_row, threads={threads}"
        )


def test_matmul_prefill_tiling_many_tokens():
    # Enough tokens and columns that the prefill path splits tokens into several blocks and rows
    # into several tiles; every element must still equal dot_row's value.
    rng = np.random.default_rng(400)
    qtype, n_rows, n, n_tokens = Q.Q4_K, 9, 16 * 256, 70
    data = random_rows(qtype, n_rows, n, rng)
    x = rng.standard_normal((n_tokens, n)).astype(np.float32)
    y = _internal.matmul(int(qtype), data, n_rows, n, x, threads=2, exact=True)
    row_bytes = data.size // n_rows
    for t in (0, 1, 63, 64, 69):
        for r in range(n_rows):
            assert bits(y[t, r]) == bits(
                _internal.dot(int(qtype), data[r * row_bytes : (r + 1) * row_bytes], x[t])
            )


# Runs in a child process per ISA (the active ISA is fixed for the life of a process), reusing
# this module's generators: argv = [isa, tests directory].
_MATMUL_PER_ISA = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[2])
    import numpy as np
    from test_quant import ALL_TYPES, PLAIN_TYPES, bits, block_size, random_rows
    from sharpi import _core, _internal
    isa = sys.argv[1]
    assert _internal.active_isa() == isa, _internal.active_isa()
    rng = np.random.default_rng(7)
    for qtype in ALL_TYPES:
        n_rows = 7
        n = 37 if qtype in PLAIN_TYPES else 3 * block_size(qtype)
        data = random_rows(qtype, n_rows, n, rng)
        row_bytes = data.size // n_rows
        x = rng.standard_normal((4, n)).astype(np.float32)
        y4 = _internal.matmul(int(qtype), data, n_rows, n, x, threads=2, exact=True)
        for t in range(4):
            y1 = _internal.matmul(int(qtype), data, n_rows, n, x[t : t + 1], threads=1, exact=True)
            rows = [data[r * row_bytes : (r + 1) * row_bytes] for r in range(n_rows)]
            ref = np.array([_internal.dot(int(qtype), row, x[t], isa) for row in rows], dtype=np.float32)
            assert np.array_equal(bits(y1[0]), bits(ref)), (qtype.name, t, "T=1")
            assert np.array_equal(bits(y4[t]), bits(ref)), (qtype.name, t, "T=4")
    print("ok")
    """
)


def run_child(code, *args, isa_env):
    env = dict(os.environ)
    if isa_env is None:
        env.pop("SHARPI_ISA", None)
    else:
        env["SHARPI_ISA"] = isa_env
    cmd = [sys.executable, "-c", code, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("isa", ISAS)
def test_matmul_each_isa_equals_its_dot_row(isa):
    proc = run_child(_MATMUL_PER_ISA, isa, os.path.dirname(os.path.abspath(__file__)), isa_env=isa)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


# ---- (e) SHARPI_ISA and unsupported types ------------------------------------------------------------

_PRINT_ISA = "from sharpi import _internal; print(_internal.active_isa())"
_BAD_ISA = textwrap.dedent(
    """
    import numpy as np
    from sharpi import InvalidArgument, _internal
    for call in (_internal.active_isa, lambda: _internal.dequantize(8, np.zeros(34, np.uint8), 32)):
        try:
            call()
        except InvalidArgument as e:
            assert "SHARPI_ISA=avx9000" in str(e), str(e)
        else:
            raise SystemExit("no InvalidArgument")
    print("ok")
    """
)


def test_sharpi_isa_override():
    best = ISAS[-1]
    assert run_child(_PRINT_ISA, isa_env=None).stdout.strip() == best
    for isa in ISAS:
        assert run_child(_PRINT_ISA, isa_env=isa).stdout.strip() == isa
    # Never above what the CPU has.
    assert run_child(_PRINT_ISA, isa_env="avx512").stdout.strip() == best
    proc = run_child(_BAD_ISA, isa_env="avx9000")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.parametrize(
    "type_id, name", [(int(Q.TQ2_0), "tq2_0"), (int(Q.Q8_K), "q8_K"), (99, "unknown (id 99)")]
)
def test_unsupported_type_raises(type_id, name):
    data = np.zeros(66, np.uint8)
    x = np.zeros(256, np.float32)
    message = f"[quant] no CPU kernel for type {name}"
    for isa in ISAS:
        with pytest.raises(
            UnsupportedError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")
        ):
            _internal.dequantize(type_id, data, 256, isa)
        with pytest.raises(UnsupportedError, match=name.split()[0]):
            _internal.dot(type_id, data, x, isa)
    with pytest.raises(UnsupportedError, match=name.split()[0]):
        _internal.matmul(type_id, data, 1, 256, x.reshape(1, -1))


def test_bad_arguments_raise_invalid_argument():
    data = np.zeros(18 * 2, np.uint8)  # two Q4_0 blocks
    with pytest.raises(InvalidArgument, match="block size 32"):
        _internal.dequantize(int(Q.Q4_0), data, 33)
    with pytest.raises(InvalidArgument, match="needs a 1-D array of 36"):
        _internal.dequantize(int(Q.Q4_0), data[:35], 64)
    with pytest.raises(InvalidArgument, match="needs a 1-D array of 18"):
        _internal.dot(int(Q.Q4_0), data, np.zeros(32, np.float32))
    with pytest.raises(InvalidArgument, match="unknown isa 'sse9'"):
        _internal.dot(int(Q.Q4_0), data, np.zeros(64, np.float32), "sse9")
    with pytest.raises(InvalidArgument, match=r"x must be \[T, 64\]"):
        _internal.matmul(int(Q.Q4_0), data, 1, 64, np.zeros((2, 32), np.float32))
    with pytest.raises(InvalidArgument, match=r"a \[2, 64\] matrix of q4_0 needs a 1-D array of 72"):
        _internal.matmul(int(Q.Q4_0), data, 2, 64, np.zeros((1, 64), np.float32))
    with pytest.raises(InvalidArgument, match="threads"):
        _internal.matmul(int(Q.Q4_0), data, 1, 64, np.zeros((1, 64), np.float32), threads=0)


# ---- (f) blocks quantized from real floats by the gguf package ----------------------------------------


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype, max_rel_rms", [(Q.Q8_0, 0.01), (Q.Q4_0, 0.15)], ids=["Q8_0", "Q4_0"])
def test_gguf_quantized_real_floats(qtype, max_rel_rms, isa):
    rng = np.random.default_rng(500 + int(qtype))
    n_rows, n = 5, 7 * 32
    original = (rng.standard_normal((n_rows, n)) * rng.uniform(0.01, 2.0, size=(n_rows, 1))).astype(
        np.float32
    )
    data = gguf_quantize(original, qtype).reshape(-1)
    row_bytes = data.size // n_rows
    want = oracle_dequantize(qtype, data, n_rows, n)
    x = rng.standard_normal(n).astype(np.float32)
    for r in range(n_rows):
        row = data[r * row_bytes : (r + 1) * row_bytes]
        got = _internal.dequantize(int(qtype), row, n, isa)
        np.testing.assert_array_equal(bits(got), bits(want[r]))
        # Sanity of the round trip itself: the quantization error is what the format allows.
        rel_rms = np.sqrt(np.mean((got - original[r]) ** 2) / np.mean(original[r] ** 2))
        assert rel_rms < max_rel_rms, rel_rms
        exact = float(np.dot(want[r].astype(np.float64), x.astype(np.float64)))
        budget = dot_budget(n) * float(np.abs(want[r].astype(np.float64) * x).sum())
        assert abs(_internal.dot(int(qtype), row, x, isa) - exact) <= budget
