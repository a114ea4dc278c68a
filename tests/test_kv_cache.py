"""KV cache types (f32, f16, q8_0, q4_0): how a K/V row is rounded when stored, and attention over
the stored rows, against float64 numpy models of the same rounding (docs/design.md §8).

Oracles: f16 rounding is numpy's astype(float16); q4_0 is the gguf package's quantizer (a bit-exact
port of llama.cpp's reference); q8_0 is modelled here (llama.cpp's SIMD rule: id = 127 / amax, round
half to even). Stored rows are decoded with the gguf package's dequantize, and attention is then
computed in float64 numpy from the same query: the engine's f32 arithmetic must land within 1e-5
relative of it on every ISA, for prefill batches and single-token decoding, with the context split
into several blocks and with grouped KV heads, in fast mode (the block kernels,
tests/test_attention_kernels.py) and in exact mode (exact=True: per-row dots, scalar exp). Fast mode is
also held to a numpy model of its own f32 arithmetic (tests/attention_f32_model.py), bit for bit.
"""

import attention_f32_model as f32_model
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from sharpi import _core, _internal

ISAS = _internal.isa_available()
TYPES = ["f32", "f16", "q8_0", "q4_0"]
GGML = {
    "f32": GGMLQuantizationType.F32,
    "f16": GGMLQuantizationType.F16,
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
}


def q8_0_model(x: np.ndarray) -> np.ndarray:
    """q8_0 blocks as the KV cache stores them: d = f16(amax / 127), qs = rint(x * (127 / amax)), f32 math."""
    blocks = x.astype(np.float32).reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax == 0, np.float32(0), np.float32(127) / amax).astype(np.float32)
    qs = np.rint(blocks * inv).astype(np.int8)
    return np.concatenate([d.astype(np.float16).view(np.uint8), qs.view(np.uint8)], axis=1).reshape(-1)


def expected_row_bytes(kind: str, x: np.ndarray) -> np.ndarray:
    if kind == "f32":
        return x.astype(np.float32).view(np.uint8)
    if kind == "f16":
        return x.astype(np.float16).view(np.uint8)
    if kind == "q8_0":
        return q8_0_model(x)
    return quants.quantize(x.astype(np.float32).reshape(1, -1), GGMLQuantizationType.Q4_0).reshape(-1)


@pytest.mark.parametrize("kind", TYPES)
def test_store_row_rounds_like_the_model(kind):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(32 * 24) * rng.choice([1e-3, 1.0, 30.0], size=32 * 24)).astype(np.float32)
    x[32:64] = 0.0  # an all-zero block (d = 0)
    x[64] = 70000.0 if kind == "f32" else 3.0  # f16 overflow is not a KV value worth testing
    got = _internal.kv_store_row(kind, x)
    np.testing.assert_array_equal(got, expected_row_bytes(kind, x))


def test_store_row_rejects_bad_input():
    with pytest.raises(_core.InvalidArgument, match="q5_k"):
        _internal.kv_store_row("q5_k", np.zeros(32, np.float32))
    with pytest.raises(_core.InvalidArgument, match="multiple of 32"):
        _internal.kv_store_row("q8_0", np.zeros(48, np.float32))


def store(kind: str, rows: np.ndarray) -> np.ndarray:
    return np.stack([_internal.kv_store_row(kind, r) for r in rows])


def decode_rows(kind: str, stored: np.ndarray, width: int) -> np.ndarray:
    """Rows as attention must read them, decoded by the gguf package (independent of sharpi)."""
    return np.stack([quants.dequantize(r, GGML[kind]).reshape(width) for r in stored]).astype(np.float64)


def attention_model(q, k, v, pos0, n_head, n_head_kv, head_dim, scale, window=0, sinks=None, chunk=0):
    """Causal GQA attention in float64: q [T, n_head * hd], k / v [n_kv, n_head_kv * hd] (decoded);
    window > 0: position p sees (p - window, p]; sinks [n_head]: a logit in each denominator only;
    chunk > 0: position p sees [floor(p / chunk) * chunk, p] (llama4's chunked layers)."""
    T = q.shape[0]
    out = np.zeros((T, n_head * head_dim))
    group = n_head // n_head_kv
    for t in range(T):
        n_kv = pos0 + t + 1
        for h in range(n_head):
            g = h // group
            qh = q[t, h * head_dim : (h + 1) * head_dim].astype(np.float64)
            j0 = max(0, n_kv - window) if window > 0 else 0
            if chunk > 0:
                j0 = max(j0, (n_kv - 1) // chunk * chunk)
            kh = k[j0:n_kv, g * head_dim : (g + 1) * head_dim]
            vh = v[j0:n_kv, g * head_dim : (g + 1) * head_dim]
            s = kh @ qh * scale
            m = s.max() if sinks is None else max(s.max(), float(sinks[h]))
            p = np.exp(s - m)
            denominator = p.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - m))
            out[t, h * head_dim : (h + 1) * head_dim] = (p / denominator) @ vh
    return out


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("chunk", [1, 100, 256, 300])
def test_chunked_attention_matches_float64_model(isa, chunk, exact):
    # llama4: chunks shorter than, equal to and longer than a 256-row block, a prefill crossing chunk
    # starts and a deep single-token decode (split path); every thread count gives the same bits, and
    # the batch gives each token its token-by-token row.
    n_head, n_head_kv, hd = 4, 2, 32
    rng = np.random.default_rng(chunk + 1)
    for pos0, T in ((0, 650), (700, 1)):
        n_kv = pos0 + T
        k = (rng.standard_normal((n_kv, n_head_kv * hd)) * 2).astype(np.float32)
        v = rng.standard_normal((n_kv, n_head_kv * hd)).astype(np.float32)
        q = rng.standard_normal((T, n_head * hd)).astype(np.float32)
        ks, vs = store("f32", k), store("f32", v)
        want = attention_model(q, k.astype(np.float64), v.astype(np.float64), pos0, n_head, n_head_kv, hd, 0.2,
                               chunk=chunk)
        results = [_internal.attention(q, ks, vs, "f32", "f32", pos0, n_head, n_head_kv, hd, 0.2, threads=th, isa=isa,
                                       chunk=chunk, exact=exact) for th in (1, 2, 3)]
        assert np.abs(results[0] - want).max() / np.abs(want).max() < 1e-5
        for got in results[1:]:
            np.testing.assert_array_equal(got, results[0])
        if T > 1:
            for t in (0, chunk - 1, chunk, T - 1):
                t = min(t, T - 1)
                one = _internal.attention(q[t : t + 1], ks, vs, "f32", "f32", t, n_head, n_head_kv, hd, 0.2, threads=2,
                                          isa=isa, chunk=chunk, exact=exact)
                np.testing.assert_array_equal(one[0], results[1][t])
            # A chunk start sees only itself: row chunk is the attention of one key, v of that row.
            if chunk < T:
                np.testing.assert_allclose(results[0][chunk].reshape(n_head, hd),
                                           np.repeat(v[chunk].reshape(n_head_kv, hd), n_head // n_head_kv, axis=0),
                                           rtol=1e-6, atol=1e-6)


# (n_head, n_head_kv, head_dim, pos0, n_tokens): a prefill batch crossing a 256-row block boundary,
# single-token decoding deep into the context (several blocks: the split path with 2+ threads), a
# few-token batch on the split path, tiles of several tokens x one KV head with a partial last tile
# (group 8: 4 tokens per tile), and a batch just past the split path's token limit.
SHAPES = [(4, 2, 64, 0, 300), (8, 2, 128, 700, 1), (4, 4, 32, 255, 2), (16, 16, 64, 520, 3), (32, 4, 32, 300, 42),
          (6, 2, 64, 513, 9)]


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind_k,kind_v", [("f32", "f32"), ("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"),
                                           ("q8_0", "f16")])
@pytest.mark.parametrize("shape", SHAPES)
def test_attention_matches_float64_model(isa, kind_k, kind_v, shape, exact):
    n_head, n_head_kv, hd, pos0, T = shape
    seed = int(np.random.SeedSequence().entropy % 2**32)  # fresh inputs every run
    rng = np.random.default_rng(seed)
    n_kv = pos0 + T
    k = (rng.standard_normal((n_kv, n_head_kv * hd)) * 2).astype(np.float32)
    v = rng.standard_normal((n_kv, n_head_kv * hd)).astype(np.float32)
    q = rng.standard_normal((T, n_head * hd)).astype(np.float32)
    scale = 1.0 / np.sqrt(hd)
    ks, vs = store(kind_k, k), store(kind_v, v)
    want = attention_model(q, decode_rows(kind_k, ks, n_head_kv * hd), decode_rows(kind_v, vs, n_head_kv * hd),
                           pos0, n_head, n_head_kv, hd, scale)
    results = []
    for threads in (1, 2, 3):
        got = _internal.attention(q, ks, vs, kind_k, kind_v, pos0, n_head, n_head_kv, hd, scale, threads=threads, isa=isa,
                              exact=exact)
        rel = np.abs(got - want).max() / np.abs(want).max()
        assert rel < 1e-5, (threads, rel, seed)
        results.append(got)
    # The partition into work items (per head, or per head and block of rows) never changes a bit.
    for got in results[1:]:
        np.testing.assert_array_equal(got, results[0])


# head_dim 40 (5 vectors of 8: the kernels' tail tiles; f32 / f16 only, the quantized types need
# whole 32-element blocks per head); group 8 (tiles of 4 tokens x 8 heads).
PREFILL_CASES = [(kind, heads) for kind in TYPES for heads in ((4, 2, 64), (16, 2, 128), (3, 3, 40))
                 if heads[2] % 32 == 0 or kind in ("f32", "f16")]


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("kind,heads", PREFILL_CASES)
def test_attention_prefill_equals_token_by_token(kind, heads, exact):
    n_head, n_head_kv, hd = heads
    n = 520
    rng = np.random.default_rng()
    ks = store(kind, rng.standard_normal((n, n_head_kv * hd)).astype(np.float32))
    vs = store(kind, rng.standard_normal((n, n_head_kv * hd)).astype(np.float32))
    q = rng.standard_normal((n, n_head * hd)).astype(np.float32)

    def attend(rows, pos0):
        return _internal.attention(rows, ks, vs, kind, kind, pos0, n_head, n_head_kv, hd, 0.125, threads=2, exact=exact)

    batch = attend(q, 0)
    for t in (0, 255, 256, 519):
        np.testing.assert_array_equal(attend(q[t : t + 1], t)[0], batch[t])
    # A few tokens at once (the split path, whole K/V rows per position) and a batch past its limit.
    for t0, m in ((300, 3), (250, 8), (262, 11)):
        np.testing.assert_array_equal(attend(q[t0 : t0 + m], t0), batch[t0 : t0 + m])


def test_fast_and_exact_mode_take_different_paths():
    # exact=True keeps the per-row arithmetic; the default runs the block kernels. Both are within
    # 1e-5 of float64 (above); their bits differ, so each test above checks the path it names.
    n_head, n_head_kv, hd, n = 4, 2, 64, 300
    rng = np.random.default_rng()
    ks = store("f16", rng.standard_normal((n, n_head_kv * hd)).astype(np.float32))
    vs = store("f16", rng.standard_normal((n, n_head_kv * hd)).astype(np.float32))
    q = rng.standard_normal((n, n_head * hd)).astype(np.float32)
    fast = _internal.attention(q, ks, vs, "f16", "f16", 0, n_head, n_head_kv, hd, 0.125, threads=2)
    exact = _internal.attention(q, ks, vs, "f16", "f16", 0, n_head, n_head_kv, hd, 0.125, threads=2, exact=True)
    assert not np.array_equal(fast, exact)
    assert np.abs(fast - exact).max() < 1e-5 * np.abs(exact).max()


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("window", [1, 100, 256, 300])
def test_sliding_window_and_sinks_match_float64_model(isa, window, exact):
    # gpt-oss: windows shorter than, equal to and longer than a 256-row block, from a prefill and a
    # deep single-token decode (split path); every thread count gives the same bits, and the batch
    # gives each token its token-by-token row.
    n_head, n_head_kv, hd = 4, 2, 32
    rng = np.random.default_rng(window)
    sinks = (rng.standard_normal(n_head) * 2).astype(np.float32)
    for pos0, T in ((0, 300), (700, 1)):
        n_kv = pos0 + T
        k = (rng.standard_normal((n_kv, n_head_kv * hd)) * 2).astype(np.float32)
        v = rng.standard_normal((n_kv, n_head_kv * hd)).astype(np.float32)
        q = rng.standard_normal((T, n_head * hd)).astype(np.float32)
        ks, vs = store("f32", k), store("f32", v)
        want = attention_model(q, k.astype(np.float64), v.astype(np.float64), pos0, n_head, n_head_kv, hd, 0.2,
                               window, sinks)
        results = [_internal.attention(q, ks, vs, "f32", "f32", pos0, n_head, n_head_kv, hd, 0.2, threads=th, isa=isa,
                                   window=window, sinks=sinks, exact=exact) for th in (1, 2, 3)]
        assert np.abs(results[0] - want).max() / np.abs(want).max() < 1e-5
        for got in results[1:]:
            np.testing.assert_array_equal(got, results[0])
        if T > 1:
            for t in (0, window - 1, T - 1):
                t = min(t, T - 1)
                one = _internal.attention(q[t : t + 1], ks, vs, "f32", "f32", t, n_head, n_head_kv, hd, 0.2, threads=2,
                                      isa=isa, window=window, sinks=sinks, exact=exact)
                np.testing.assert_array_equal(one[0], results[1][t])


# (n_head, n_head_kv, head_dim, pos0, n_tokens, window, with sinks): prefill tiles of 64 and 16 tokens in
# one block; a deep single-token decode (split path, 3 blocks); a few tokens on the split path; a batch
# crossing a block boundary (tile path, 2 blocks); a sliding window with sinks.
F32_MODEL_SHAPES = [(4, 1, 128, 0, 64, 0, False), (4, 2, 64, 0, 64, 0, False), (8, 2, 128, 700, 1, 0, False),
                    (6, 2, 64, 513, 9, 0, False), (4, 4, 64, 250, 20, 0, False), (4, 2, 64, 500, 3, 300, True)]


def fast_attention_vs_f32_model(rng, isa, kind_k, kind_v, shape):
    """(got, want) for fast-mode attention over stored rows and the f32 model over the gguf-decoded rows."""
    n_head, n_head_kv, hd, pos0, T, window, with_sinks = shape
    n_kv = pos0 + T
    k = (rng.standard_normal((n_kv, n_head_kv * hd)) * 2).astype(np.float32)
    v = rng.standard_normal((n_kv, n_head_kv * hd)).astype(np.float32)
    q = rng.standard_normal((T, n_head * hd)).astype(np.float32)
    sinks = (rng.standard_normal(n_head) * 2).astype(np.float32) if with_sinks else None
    scale = 1.0 / np.sqrt(hd)
    ks, vs = store(kind_k, k), store(kind_v, v)
    # gguf decodes f16 exactly and q8_0 / q4_0 as one f32 multiply per element, as the row kernels do
    kd = decode_rows(kind_k, ks, n_head_kv * hd).astype(np.float32)
    vd = decode_rows(kind_v, vs, n_head_kv * hd).astype(np.float32)
    got = _internal.attention(q, ks, vs, kind_k, kind_v, pos0, n_head, n_head_kv, hd, scale, threads=2, isa=isa,
                          window=window, sinks=sinks)
    want = f32_model.attention(q, kd, vd, pos0, n_head, n_head_kv, hd, scale, simd=isa != "scalar", window=window,
                               sinks=sinks)
    return got, want


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind_k,kind_v", [("f32", "f32"), ("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"),
                                           ("q8_0", "f16")])
@pytest.mark.parametrize("shape", F32_MODEL_SHAPES)
def test_fast_attention_matches_f32_model(isa, kind_k, kind_v, shape):
    # One block without sinks merges only with expf(-inf) = 0 and expf(0) = 1: bit-identical. Otherwise
    # libm's expf in the merge misses correct rounding for ~0.07% of arguments (an ulp in a or b):
    # measured over 1,200 draws (20 per shape, types and ISA): 24 not bit-identical, all in those cases,
    # max |got - want| / max |want| per row 1.1e-7, so 1e-6 leaves a 9x margin.
    seed = int(np.random.SeedSequence().entropy % 2**32)
    got, want = fast_attention_vs_f32_model(np.random.default_rng(seed), isa, kind_k, kind_v, shape)
    _, _, hd, pos0, T, _, with_sinks = shape
    if pos0 + T <= 256 and not with_sinks:
        np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}")
    else:
        rows_got, rows_want = got.reshape(-1, hd), want.reshape(-1, hd)
        rel = np.abs(rows_got - rows_want).max(axis=1) / np.abs(rows_want).max(axis=1)
        assert rel.max() <= 1e-6, (rel.max(), seed)


@pytest.mark.parametrize("kind", ["f32", "f16"])
def test_head_dim_off_the_lanes_takes_the_exact_path(kind):
    # head_dim 36 is no multiple of the kernels' 8 lanes: fast mode runs exact mode's per-row arithmetic
    # (checked against float64 above), so the two give the same bits.
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    n_head, n_head_kv, hd = 4, 2, 36
    for pos0, T in ((0, 40), (600, 1)):
        k = rng.standard_normal((pos0 + T, n_head_kv * hd)).astype(np.float32)
        v = rng.standard_normal((pos0 + T, n_head_kv * hd)).astype(np.float32)
        q = rng.standard_normal((T, n_head * hd)).astype(np.float32)
        ks, vs = store(kind, k), store(kind, v)
        fast, exact = (_internal.attention(q, ks, vs, kind, kind, pos0, n_head, n_head_kv, hd, 0.15, threads=2, exact=e)
                       for e in (False, True))
        np.testing.assert_array_equal(fast, exact, err_msg=f"seed {seed}")


def mla_attention_model(q_abs, latent, pos0, n_head, n_lora_kv, n_rot, scale):
    """deepseek2's absorbed-form latent attention in float64: q_abs [T, n_head * (n_lora_kv + n_rot)],
    latent [n_kv, n_lora_kv + n_rot] (decoded rows: c then k_pe). Every head scores q_abs_h . row_j
    and returns the softmax-weighted sum of the rows' first n_lora_kv values (c_j)."""
    T, width = q_abs.shape[0], n_lora_kv + n_rot
    out = np.zeros((T, n_head * n_lora_kv))
    for t in range(T):
        rows = latent[: pos0 + t + 1]
        s = q_abs[t].astype(np.float64).reshape(n_head, width) @ rows.T * scale
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        out[t] = (p @ rows[:, :n_lora_kv]).reshape(-1)
    return out


# (n_head, n_lora_kv, n_rot, pos0, n_tokens): DeepSeek-V2-Lite's latent (512 + 64) decoding one token
# deep into the context; a prefill batch of 5 heads (a partial last group of heads) over more than
# one 64-row decode block; a few tokens of the converter test models' narrow latent widened to 32s.
MLA_SHAPES = [(16, 512, 64, 150, 1), (5, 256, 32, 0, 70), (3, 64, 32, 130, 3)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("shape", MLA_SHAPES)
def test_mla_attention_over_stored_latent_matches_float64_model(isa, kind, shape):
    n_head, n_lora_kv, n_rot, pos0, T = shape
    width = n_lora_kv + n_rot
    rng = np.random.default_rng(hash((kind, shape)) % 2**32)
    latent = rng.standard_normal((pos0 + T, width)).astype(np.float32)
    latent[:, n_lora_kv:] *= 3.0  # the RoPE part has its own scale
    q_abs = (rng.standard_normal((T, n_head * width)) * 0.3).astype(np.float32)
    scale = 1.0 / np.sqrt(192)
    stored = store(kind, latent)
    want = mla_attention_model(q_abs, decode_rows(kind, stored, width), pos0, n_head, n_lora_kv, n_rot, scale)
    results = []
    for threads in (1, 2, 3):
        got = _internal.mla_attention(q_abs, stored, kind, pos0, n_head, n_lora_kv, n_rot, scale, threads=threads,
                                  isa=isa)
        rel = np.abs(got - want).max() / np.abs(want).max()
        assert rel < 1e-5, (threads, rel)
        results.append(got)
    for got in results[1:]:
        np.testing.assert_array_equal(got, results[0])
    if kind != "f32":  # the rounding is really there: the f32 latent's answer is measurably different
        exact = mla_attention_model(q_abs, latent.astype(np.float64), pos0, n_head, n_lora_kv, n_rot, scale)
        assert np.abs(got - exact).max() / np.abs(exact).max() > 1e-5


@pytest.mark.parametrize("kind", TYPES)
def test_mla_attention_prefill_equals_token_by_token(kind):
    n_head, n_lora_kv, n_rot, n = 4, 128, 32, 140
    rng = np.random.default_rng(11)
    stored = store(kind, rng.standard_normal((n, n_lora_kv + n_rot)).astype(np.float32))
    q_abs = rng.standard_normal((n, n_head * (n_lora_kv + n_rot))).astype(np.float32)
    batch = _internal.mla_attention(q_abs, stored, kind, 0, n_head, n_lora_kv, n_rot, 0.1, threads=2)
    for t in (0, 63, 64, 139):
        one = _internal.mla_attention(q_abs[t : t + 1], stored, kind, t, n_head, n_lora_kv, n_rot, 0.1, threads=2)
        np.testing.assert_array_equal(one[0], batch[t])
    few = _internal.mla_attention(q_abs[60:70], stored, kind, 60, n_head, n_lora_kv, n_rot, 0.1, threads=2)
    np.testing.assert_array_equal(few, batch[60:70])
