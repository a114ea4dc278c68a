"""The CUDA kernels on a device, against independent oracles (marker `gpu`; skipped without a device).

- dequantize: the gguf package's numpy dequantize, bit for bit;
- q8 activation quantization: test_qdot's numpy model, bit for bit (the device builds the same
  bytes as the CPU);
- int8 matvec: a numpy float32 replay of the kernel's arithmetic (block partials as block_math.cuh
  states, lane l summing blocks l, l + 32, ..., then the warp's xor-butterfly), bit for bit; the
  tiled prefill matmul equals the matvec bit for bit;
- exact matvec, RMSNorm, RoPE, SiLU·mul, attention, router, the fused expert FFN: float64 numpy
  within stated f32 budgets; the grouped (prefill) expert FFN equals the per-token (decode) one bit
  for bit.
Fresh random inputs each run (the seed is printed on failure).
"""

import os

import numpy as np
import pytest
import sharpi
from gguf import GGMLQuantizationType as Q
from sharpi import _internal
from test_cuda_host import model_block_partials
from test_qdot import FAST_TYPES, FORMAT, K_TYPES, np_quantize, random_activations
from test_quant import ALL_TYPES, bits, oracle_dequantize, random_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not sharpi.cuda_available(), reason="no CUDA device"),
]

F32 = np.float32

# The types the device block math implements (issue 21's list). MXFP4 and the IQ types came to the
# CPU later and are not on the device yet: the block math refuses them (test_cuda_host checks that).
NOT_ON_DEVICE = {Q.MXFP4, Q.IQ4_NL, Q.IQ4_XS, Q.IQ3_S, Q.IQ3_XXS, Q.IQ2_S, Q.IQ2_XS, Q.IQ2_XXS, Q.IQ1_S, Q.IQ1_M}
DEVICE_TYPES = [t for t in ALL_TYPES if t not in NOT_ON_DEVICE]
DEVICE_FAST_TYPES = [t for t in FAST_TYPES if t not in NOT_ON_DEVICE]
U = 2.0**-24


@pytest.fixture
def rng(request):
    seed = int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def block_elems(qtype):
    return 256 if qtype in K_TYPES else 32


def warp_tree(lanes):
    """The value lane 0 holds after warp_sum's xor butterfly (offsets 16, 8, 4, 2, 1), in f32."""
    v = np.asarray(lanes, F32).copy()
    for offset in (16, 8, 4, 2, 1):
        v = (v + v[np.arange(32) ^ offset]).astype(F32)
    return v[0]


def model_row_q8(qtype, row_bytes, xq):
    """The int8 matvec of one row, replayed: per-lane sequential f32 sums of the block partials."""
    partials, _ = model_block_partials(qtype, row_bytes, xq)
    lanes = np.zeros(32, F32)
    for ib, p in enumerate(partials):
        lanes[ib % 32] = F32(lanes[ib % 32] + p)
    return warp_tree(lanes)


# ---- dequantize / quantize ---------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", DEVICE_TYPES, ids=lambda t: t.name)
def test_gpu_dequantize_bitwise_equals_gguf(qtype, rng):
    n = 40 * (256 if qtype in K_TYPES else 32)
    data = random_rows(qtype, 1, n, rng)
    got = _internal.cuda_op_dequantize(int(qtype), data)
    want = oracle_dequantize(qtype, data, 1, n)[0]
    assert np.array_equal(bits(got), bits(want))


@pytest.mark.parametrize("qtype", DEVICE_FAST_TYPES, ids=lambda t: t.name)
def test_gpu_quantize_act_bitwise_equals_numpy(qtype, rng):
    n_tokens, n = 3, 1024
    x = np.concatenate([random_activations(rng, n) for _ in range(n_tokens)])
    got = _internal.cuda_op_quantize_act(int(qtype), x, n_tokens)
    want = np_quantize(FORMAT[qtype], x)
    assert np.array_equal(got, want)


# ---- matrix products ---------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", DEVICE_TYPES, ids=lambda t: t.name)
def test_gpu_exact_matvec_within_f32_budget_of_float64(qtype, rng):
    n_rows, n_cols, n_tokens = 37, 8 * 256, 3
    w = random_rows(qtype, n_rows, n_cols, rng)
    x = rng.standard_normal(n_tokens * n_cols).astype(F32)
    got = _internal.cuda_op_matmul(int(qtype), w, n_rows, n_cols, x, n_tokens).reshape(n_tokens, n_rows)
    wd = oracle_dequantize(qtype, w, n_rows, n_cols).astype(np.float64)
    xd = x.reshape(n_tokens, n_cols).astype(np.float64)
    want = xd @ wd.T
    # Per lane n_cols / 32 products and sums, then 5 tree levels: gamma(n_cols / 32 + 6) of sum|w x|.
    m = n_cols // 32 + 6
    bound = m * U / (1 - m * U) * (np.abs(xd) @ np.abs(wd).T)
    assert np.all(np.abs(got - want) <= bound)


@pytest.mark.parametrize("qtype", DEVICE_FAST_TYPES, ids=lambda t: t.name)
def test_gpu_int8_matvec_bitwise_equals_numpy_model(qtype, rng):
    n_rows, n_cols = 9, 40 * 256  # 40 K-blocks / 320 small blocks per row: lanes wrap around
    w = random_rows(qtype, n_rows, n_cols, rng)
    x = random_activations(rng, n_cols)
    got = _internal.cuda_op_matmul(int(qtype), w, n_rows, n_cols, x, 1, int8=True)
    xq = np_quantize(FORMAT[qtype], x)
    rows = w.reshape(n_rows, -1)
    want = np.array([model_row_q8(qtype, rows[r], xq) for r in range(n_rows)], F32)
    bad = np.flatnonzero(bits(got) != bits(want))
    assert bad.size == 0, f"{qtype.name}: rows {bad}: {got[bad]} vs {want[bad]}"


@pytest.mark.parametrize("qtype", DEVICE_FAST_TYPES, ids=lambda t: t.name)
def test_gpu_tiled_prefill_matmul_equals_decode_matvec(qtype, rng):
    n_rows, n_cols, n_tokens = 13, 36 * 256, 19  # tokens not a multiple of the 8-token tile
    w = random_rows(qtype, n_rows, n_cols, rng)
    x = np.concatenate([random_activations(rng, n_cols) for _ in range(n_tokens)])
    tiled = _internal.cuda_op_matmul(int(qtype), w, n_rows, n_cols, x, n_tokens, int8=True, tiled=True)
    per_token = np.concatenate(
        [_internal.cuda_op_matmul(int(qtype), w, n_rows, n_cols, x[t * n_cols : (t + 1) * n_cols], 1, int8=True)
         for t in range(n_tokens)]
    )
    assert np.array_equal(bits(tiled), bits(per_token))


# ---- elementwise, norm, rope, router, attention ------------------------------------------------------


def test_gpu_rms_norm_silu_mul(rng):
    n_tokens, n = 5, 3000
    x = rng.standard_normal(n_tokens * n).astype(F32)
    w = rng.standard_normal(n).astype(F32)
    got = _internal.cuda_op_rms_norm(x, w, 1e-6).reshape(n_tokens, n)
    xd = x.reshape(n_tokens, n).astype(np.float64)
    want = xd / np.sqrt((xd**2).mean(axis=1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    g, u = rng.standard_normal(4096).astype(F32) * 4, rng.standard_normal(4096).astype(F32)
    gd = g.astype(np.float64)
    np.testing.assert_allclose(_internal.cuda_op_silu_mul(g, u), gd / (1 + np.exp(-gd)) * u, rtol=1e-5, atol=1e-6)


def np_rope(x, n_tokens, n_heads, head_dim, pos0, n_rot, neox, base):
    out = x.reshape(n_tokens, n_heads, head_dim).astype(np.float64).copy()
    half = n_rot // 2
    for t in range(n_tokens):
        theta = (pos0 + t) * base ** (-2.0 * np.arange(half) / n_rot)
        c, s = np.cos(theta), np.sin(theta)
        a = np.arange(half) if neox else 2 * np.arange(half)
        b = a + half if neox else a + 1
        x0, x1 = out[t][:, a].copy(), out[t][:, b].copy()
        out[t][:, a] = x0 * c - x1 * s
        out[t][:, b] = x0 * s + x1 * c
    return out.reshape(-1)


@pytest.mark.parametrize("neox", [False, True], ids=["normal", "neox"])
def test_gpu_rope(neox, rng):
    n_tokens, n_heads, head_dim, n_rot, pos0 = 4, 3, 128, 64, 1000
    x = rng.standard_normal(n_tokens * n_heads * head_dim).astype(F32)
    got = _internal.cuda_op_rope(x, n_tokens, n_heads, head_dim, pos0, n_rot, neox, 1e6)
    np.testing.assert_allclose(got, np_rope(x, n_tokens, n_heads, head_dim, pos0, n_rot, neox, 1e6), atol=2e-6 * 8)


def np_rope_angles(n_tokens, pos0, n_rot, freq_base, freq_scale, ext_factor, corr_low, corr_high, freq_factors):
    """[n_tokens, n_rot / 2] angles of cpu/ops/rope.cpp in float64: YaRN's ramp and the factors."""
    i = np.arange(n_rot // 2, dtype=np.float64)
    inv_freq = freq_base ** (-2.0 * i / n_rot)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float64)
    pos = np.arange(pos0, pos0 + n_tokens, dtype=np.float64)[:, None]
    theta = pos * freq_scale * inv_freq
    if ext_factor:
        mix = (1.0 - np.clip((i - corr_low) / max(0.001, corr_high - corr_low), 0.0, 1.0)) * ext_factor
        theta = theta * (1.0 - mix) + pos * inv_freq * mix
    return theta


@pytest.mark.parametrize("yarn, factors", [(True, False), (False, True)], ids=["yarn", "freq-factors"])
def test_gpu_rope_yarn_and_frequency_factors(yarn, factors, rng):
    """gpt-oss's YaRN (ramp over [corr_low, corr_high], mscale on cos and sin) and llama4's rope_freqs."""
    n_tokens, n_heads, head_dim, n_rot, pos0, base = 5, 3, 64, 64, 70000, 150000.0
    x = rng.standard_normal(n_tokens * n_heads * head_dim).astype(F32)
    yarn_kw = {"freq_scale": 1 / 32, "ext_factor": 1.0, "corr_low": 8.0, "corr_high": 24.0, "mscale": 1.35}
    yarn_kw = yarn_kw if yarn else {}
    freq_factors = rng.uniform(1.0, 8.0, n_rot // 2).astype(F32) if factors else None
    got = _internal.cuda_op_rope(x, n_tokens, n_heads, head_dim, pos0, n_rot, True, base, freq_factors=freq_factors,
                                 **yarn_kw)  # fmt: skip
    theta = np_rope_angles(n_tokens, pos0, n_rot, base, yarn_kw.get("freq_scale", 1.0), yarn_kw.get("ext_factor", 0.0),
                           yarn_kw.get("corr_low", 0.0), yarn_kw.get("corr_high", 0.0), freq_factors)  # fmt: skip
    m = yarn_kw.get("mscale", 1.0)
    cos, sin = (np.cos(theta) * m)[:, None, :], (np.sin(theta) * m)[:, None, :]
    v = x.reshape(n_tokens, n_heads, head_dim).astype(np.float64)
    half = n_rot // 2
    want = v.copy()
    want[..., :half] = v[..., :half] * cos - v[..., half:n_rot] * sin  # NeoX pairs (i, i + n_rot / 2)
    want[..., half:n_rot] = v[..., :half] * sin + v[..., half:n_rot] * cos
    np.testing.assert_allclose(got, want.reshape(-1), atol=2e-6 * 8)


@pytest.mark.parametrize("normalize", [False, True])
def test_gpu_router_softmax_topk(normalize, rng):
    n_tokens, n_expert, k = 7, 128, 8
    logits = rng.standard_normal(n_tokens * n_expert).astype(F32)
    logits[:n_expert][[3, 9]] = 5.0  # an exact tie: the lower id goes first
    out = _internal.cuda_op_router(logits, n_expert, k, normalize)
    ids = out[: n_tokens * k].reshape(n_tokens, k).astype(np.int64)
    weights = out[n_tokens * k :].reshape(n_tokens, k)
    ld = logits.reshape(n_tokens, n_expert).astype(np.float64)
    probs = np.exp(ld - ld.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    want_ids = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    assert np.array_equal(ids, want_ids)
    want_w = np.take_along_axis(probs, want_ids, axis=1)
    if normalize:
        want_w /= want_w.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(weights, want_w, rtol=1e-5)


@pytest.mark.parametrize(
    "gating, bias, scale, rank_logits",
    [("sigmoid", True, 2.5, False), ("sigmoid", False, 1.0, True), ("sqrt_softplus", True, 1.5, False)],
    ids=["sigmoid-bias-scale", "sigmoid-rank-logits", "sqrt-softplus-bias-scale"],
)
def test_gpu_router_gating_variants(gating, bias, scale, rank_logits, rng):
    """glm4moe / minimax-m2 / nemotron_h_moe (sigmoid, selection bias, scale), llama4 (ranked by
    the logits), deepseek4 (sqrt(softplus)) against a float64 numpy model of cpu/ops/router.cpp."""
    n_tokens, n_expert, k = 5, 256, 8
    logits = rng.standard_normal(n_tokens * n_expert).astype(F32) * 3
    selection_bias = (rng.standard_normal(n_expert) * 0.5).astype(F32) if bias else None
    out = _internal.cuda_op_router(logits, n_expert, k, True, gating=gating, scale=scale,
                                   selection_bias=selection_bias, rank_logits=rank_logits)  # fmt: skip
    ids = out[: n_tokens * k].reshape(n_tokens, k).astype(np.int64)
    weights = out[n_tokens * k :].reshape(n_tokens, k)
    ld = logits.reshape(n_tokens, n_expert).astype(np.float64)
    gate = 1.0 / (1.0 + np.exp(-ld)) if gating == "sigmoid" else np.sqrt(np.logaddexp(0.0, ld))
    sel = (ld if rank_logits else gate) + (selection_bias if bias else 0.0)
    want_ids = np.argsort(-sel, axis=1, kind="stable")[:, :k]
    assert np.array_equal(ids, want_ids)
    want_w = np.take_along_axis(gate, want_ids, axis=1)
    want_w = want_w / want_w.sum(axis=1, keepdims=True) * scale
    np.testing.assert_allclose(weights, want_w, rtol=1e-5)


def np_attention(q, k_cache, v_cache, n_tokens, pos0, n_head, n_head_kv, head_dim, scale, window=0, chunk=0,
                 sinks=None):  # fmt: skip
    q = q.reshape(n_tokens, n_head, head_dim).astype(np.float64)
    kc = k_cache.reshape(-1, n_head_kv, head_dim).astype(np.float64)
    vc = v_cache.reshape(-1, n_head_kv, head_dim).astype(np.float64)
    out = np.zeros_like(q)
    for t in range(n_tokens):
        pos = pos0 + t
        first = max(0, pos - window + 1) if window else 0
        if chunk:
            first = max(first, pos // chunk * chunk)
        for h in range(n_head):
            kvh = h // (n_head // n_head_kv)
            s = kc[first : pos + 1, kvh] @ q[t, h] * scale
            mx = s.max() if sinks is None else max(s.max(), float(sinks[h]))
            p = np.exp(s - mx)
            denominator = p.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - mx))
            out[t, h] = p @ vc[first : pos + 1, kvh] / denominator
    return out.reshape(-1)


@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_gpu_attention_decode_and_prefill(head_dim, rng):
    n_head, n_head_kv, pos0, n_tokens = 8, 2, 37, 6
    n_kv = pos0 + n_tokens
    q = rng.standard_normal(n_tokens * n_head * head_dim).astype(F32)
    kc = rng.standard_normal(n_kv * n_head_kv * head_dim).astype(F32)
    vc = rng.standard_normal(n_kv * n_head_kv * head_dim).astype(F32)
    scale = 1.0 / np.sqrt(head_dim)
    prefill = _internal.cuda_op_attention(q, kc, vc, n_tokens, pos0, n_head, n_head_kv, head_dim, scale)
    want = np_attention(q, kc, vc, n_tokens, pos0, n_head, n_head_kv, head_dim, scale)
    np.testing.assert_allclose(prefill, want, rtol=1e-4, atol=1e-5)
    # Token by token (each token sees only the cache up to itself) gives the same bits.
    width, kv_width = n_head * head_dim, n_head_kv * head_dim
    decode = np.concatenate(
        [
            _internal.cuda_op_attention(
                q[t * width : (t + 1) * width], kc[: (pos0 + t + 1) * kv_width], vc[: (pos0 + t + 1) * kv_width],
                1, pos0 + t, n_head, n_head_kv, head_dim, scale,
            )
            for t in range(n_tokens)
        ]
    )
    assert np.array_equal(bits(decode), bits(prefill))


@pytest.mark.parametrize("window, chunk, with_sinks", [(8, 0, True), (0, 16, False), (0, 0, True)],
                         ids=["window-sinks", "chunk", "sinks"])  # fmt: skip
def test_gpu_attention_limits_and_sinks(window, chunk, with_sinks, rng):
    """gpt-oss's sliding window and sinks, llama4's chunks: each token's first key and the sink's
    denominator term as AttentionShape defines them; prefill equals decode bit for bit."""
    n_head, n_head_kv, head_dim, pos0, n_tokens = 8, 2, 64, 29, 7
    n_kv = pos0 + n_tokens
    q = rng.standard_normal(n_tokens * n_head * head_dim).astype(F32)
    kc = rng.standard_normal(n_kv * n_head_kv * head_dim).astype(F32)
    vc = rng.standard_normal(n_kv * n_head_kv * head_dim).astype(F32)
    sinks = rng.standard_normal(n_head).astype(F32) * 2 if with_sinks else None
    scale = 1.0 / np.sqrt(head_dim)
    args = (n_head, n_head_kv, head_dim, scale)
    prefill = _internal.cuda_op_attention(q, kc, vc, n_tokens, pos0, *args, window=window, chunk=chunk, sinks=sinks)
    want = np_attention(q, kc, vc, n_tokens, pos0, *args, window=window, chunk=chunk, sinks=sinks)
    np.testing.assert_allclose(prefill, want, rtol=1e-4, atol=1e-5)
    width, kv_width = n_head * head_dim, n_head_kv * head_dim
    decode = np.concatenate([
        _internal.cuda_op_attention(q[t * width : (t + 1) * width], kc[: (pos0 + t + 1) * kv_width],
                                    vc[: (pos0 + t + 1) * kv_width], 1, pos0 + t, *args, window=window, chunk=chunk,
                                    sinks=sinks)
        for t in range(n_tokens)
    ])  # fmt: skip
    assert np.array_equal(bits(decode), bits(prefill))


# ---- fused expert FFN ---------------------------------------------------------------------------------


def random_expert_inputs(qtype, n_embd, n_ff, n_expert, k, n_tokens, rng):
    """Stacked gate / up / down of qtype, the input rows, k distinct experts per token and their weights."""
    gate = random_rows(qtype, n_expert * n_ff, n_embd, rng)
    up = random_rows(qtype, n_expert * n_ff, n_embd, rng)
    down = random_rows(qtype, n_expert * n_embd, n_ff, rng)
    x = (rng.standard_normal(n_tokens * n_embd) * 0.5).astype(F32)
    ids = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(n_tokens)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, size=(n_tokens, k)).astype(F32)
    return gate, up, down, x, ids, weights


def dequantized_experts(qtype, gate, up, down, n_expert, n_ff, n_embd):
    """The stacked gate, up [n_expert, n_ff, n_embd] and down [n_expert, n_embd, n_ff] in float64."""
    g = oracle_dequantize(qtype, gate, n_expert * n_ff, n_embd).reshape(n_expert, n_ff, n_embd)
    u = oracle_dequantize(qtype, up, n_expert * n_ff, n_embd).reshape(n_expert, n_ff, n_embd)
    d = oracle_dequantize(qtype, down, n_expert * n_embd, n_ff).reshape(n_expert, n_embd, n_ff)
    return g.astype(np.float64), u.astype(np.float64), d.astype(np.float64)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("int8", [False, True], ids=["exact", "int8"])
def test_gpu_expert_ffn_grouped_equals_decode_and_float64(qtype, int8, rng):
    if int8 and qtype == Q.F32:
        pytest.skip("f32 weights have no int8 path (they take the exact one in both modes)")
    n_embd, n_ff, n_expert, k, n_tokens = 512, 256, 8, 2, 11
    gate, up, down, x, ids, weights = random_expert_inputs(qtype, n_embd, n_ff, n_expert, k, n_tokens, rng)
    args = (int(qtype), gate, int(qtype), up, int(qtype), down, n_embd, n_ff, n_expert, x, ids.reshape(-1),
            weights.reshape(-1))
    decode = _internal.cuda_op_expert_ffn(*args, int8=int8, grouped=False)
    grouped = _internal.cuda_op_expert_ffn(*args, int8=int8, grouped=True)
    assert np.array_equal(bits(decode), bits(grouped))
    g, u, d = dequantized_experts(qtype, gate, up, down, n_expert, n_ff, n_embd)
    xd = x.reshape(n_tokens, n_embd).astype(np.float64)
    want = np.zeros((n_tokens, n_embd))
    for t in range(n_tokens):
        for s in range(k):
            e = ids[t, s]
            a, b = g[e] @ xd[t], u[e] @ xd[t]
            want[t] += weights[t, s] * (d[e] @ (a / (1 + np.exp(-a)) * b))
    err = np.abs(decode.reshape(n_tokens, n_embd) - want).max() / np.abs(want).max()
    # Exact: f32 sums only (1e-5). int8: activation quantization, ~1e-2 as llama.cpp's q8 path.
    assert err <= (3e-2 if int8 else 1e-5), f"relative error {err:.2e}"


def np_expert_activation(activation, limit, g, u):
    """cpu/ops/activation.cpp's expert activations in float64."""
    if activation == "relu_sqr":
        return np.maximum(u, 0.0) ** 2
    if activation == "swiglu":
        return g / (1 + np.exp(-g)) * u
    g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
    if activation == "swiglu_clamped":
        return g / (1 + np.exp(-g)) * u
    return g / (1 + np.exp(-1.702 * g)) * (u + 1.0)  # swiglu_oai (gpt-oss)


@pytest.mark.parametrize("activation, limit, biases", [("swiglu_oai", 7.0, True), ("swiglu_clamped", 0.3, False),
                                                       ("relu_sqr", 0.0, False)])  # fmt: skip
@pytest.mark.parametrize("int8", [False, True], ids=["exact", "int8"])
def test_gpu_expert_ffn_variants_grouped_equal_decode_and_float64(activation, limit, biases, int8, rng):
    """gpt-oss's biased clamped SwiGLU, DeepSeek-V4's clamped SwiGLU, Nemotron-H's ungated relu^2 (of
    up alone) through the stacked decode and the grouped path."""
    qtype = Q.Q8_0
    n_embd, n_ff, n_expert, k, n_tokens = 512, 256, 8, 4, 9
    gate, up, down, x, ids, weights = random_expert_inputs(qtype, n_embd, n_ff, n_expert, k, n_tokens, rng)
    bias = {}
    if biases:
        bias = {"gate_b": (rng.standard_normal(n_expert * n_ff) * 0.3).astype(F32),
                "up_b": (rng.standard_normal(n_expert * n_ff) * 0.3).astype(F32),
                "down_b": (rng.standard_normal(n_expert * n_embd) * 0.3).astype(F32)}  # fmt: skip
    args = (int(qtype), gate, int(qtype), up, int(qtype), down, n_embd, n_ff, n_expert, x, ids.reshape(-1),
            weights.reshape(-1))
    kw = dict(int8=int8, activation=activation, limit=limit, **bias)
    decode = _internal.cuda_op_expert_ffn(*args, grouped=False, **kw)
    grouped = _internal.cuda_op_expert_ffn(*args, grouped=True, **kw)
    assert np.array_equal(bits(decode), bits(grouped))
    g, u, d = dequantized_experts(qtype, gate, up, down, n_expert, n_ff, n_embd)
    bg, bu, bd = (bias[n].astype(np.float64).reshape(n_expert, -1) if biases else np.zeros((n_expert, m))
                  for n, m in (("gate_b", n_ff), ("up_b", n_ff), ("down_b", n_embd)))  # fmt: skip
    xd = x.reshape(n_tokens, n_embd).astype(np.float64)
    want = np.zeros((n_tokens, n_embd))
    for t in range(n_tokens):
        for s in range(k):
            e = ids[t, s]
            h = np_expert_activation(activation, limit, g[e] @ xd[t] + bg[e], u[e] @ xd[t] + bu[e])
            want[t] += weights[t, s] * (d[e] @ h + bd[e])
    err = np.abs(decode.reshape(n_tokens, n_embd) - want).max() / np.abs(want).max()
    assert err <= (3e-2 if int8 else 1e-5), f"{activation}: relative error {err:.2e}"


# ---- the session entry ----------------------------------------------------------------------------------


def test_gpu_session_refuses_an_arch_the_device_path_does_not_compute(tmp_path):
    from sharpi.make_model import write_model

    path = str(tmp_path / "dense-qwen3.gguf")
    write_model(path, arch="qwen3", preset="tiny", seed=1)
    with pytest.raises(sharpi.UnsupportedError, match=r"device=\"cuda\" for qwen3: .*not qwen3 without experts"):
        sharpi.Session(path, device="cuda")


# ---- the device forward pass end to end: Session(device="cuda") against Session(device="cpu") --------
#
# Files: make-model's tiny preset on every plain-MoE arch the device path computes, in the issue's
# quant types (f32 and f16 weights, the 32-element types, K-quant mixes). The CPU engine is the
# oracle here; it is itself checked against float64 numpy and transformers by the CPU suites.
#
# Budgets, measured on a lent H200 (session 33; the CPU side on that machine's AVX-512 kernels):
# - exact mode: both engines dequantize the same weights to the same f32 (block_math.cuh is checked
#   bit for bit against the gguf package) and differ only in f32 summation order (warp trees vs the
#   CPU's SIMD lanes) and expf. Measured worst relative error over the 24 arch x type files, prompt
#   rows and 32 greedy steps: 4.9e-7 (q4_k_m; f32 weights 4.0e-7). The budget stays issue 21's 1e-4
#   for every type (the types share the arithmetic after dequantization).
# - fast mode: the same q8 activation bytes whenever the f32 inputs agree, but an input that differs
#   in its last bit can round to another q8 code and flip a router near-tie, and the CPU's fast KV
#   cache defaults to f16 (the CPU session here is given f32 KV to compare like with like); checked
#   per metric as test_fast_mode.py checks fast against exact (FAST_* below). Measured over the 16
#   files: median <= 7.4e-3, worst <= 1.28e-2, argmax agreement >= 0.979.
# - prefill vs token-by-token on the device: the kernels are written to give the same bits (the
#   tiled matmul sums as the matvec, the grouped expert FFN as the decode one, attention per token
#   over its own prefix), so equality is asserted bit for bit, as on the CPU (and holds: measured).

E2E_ARCHES = ("qwen3moe", "qwen2moe", "olmoe", "llama")  # llama with experts: Mixtral's layout
E2E_QUANTS = ("f32", "f16", "q8_0", "q4_0", "q4_k_m", "q6_k")
EXACT_BUDGET = {q: 1e-4 for q in E2E_QUANTS}  # measured worst 4.9e-7 (see above)
# Fast mode: about 3x (median), 8x (worst) the measured values above, and 0.9 agreement (measured 0.979:
# one flipped argmax in 48 positions); another host's CPU kernels (AVX2) round the oracle differently.
FAST_MEDIAN_BUDGET, FAST_WORST_BUDGET, FAST_AGREEMENT_MIN = 2e-2, 0.1, 0.9
N_GREEDY = 32


@pytest.fixture(scope="module")
def e2e_files(tmp_path_factory):
    from sharpi.make_model import write_model

    root = tmp_path_factory.mktemp("cuda_e2e")
    cache = {}

    def get(arch, quant):
        if (arch, quant) not in cache:
            path = str(root / f"{arch}-{quant}.gguf")
            write_model(path, arch=arch, preset="tiny", quant=quant, seed=11)
            cache[arch, quant] = path
        return cache[arch, quant]

    return get


def prompt_tokens(n, seed=5, n_vocab=1024):
    return [int(t) for t in np.random.default_rng(seed).integers(1, n_vocab, size=n)]


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


def greedy(session, prompt, n):
    """Prompt, then n greedy tokens: (tokens, [logits of each step])."""
    session.reset()
    logits = np.asarray(session.decode(prompt))
    tokens, steps = [], [logits]
    for _ in range(n):
        tokens.append(int(np.argmax(logits)))
        logits = np.asarray(session.decode([tokens[-1]]))
        steps.append(logits)
    return tokens, steps


@pytest.mark.parametrize("quant", E2E_QUANTS)
@pytest.mark.parametrize("arch", E2E_ARCHES)
def test_gpu_exact_matches_cpu_exact_and_the_same_greedy_tokens(e2e_files, arch, quant, record_property):
    path = e2e_files(arch, quant)
    prompt = prompt_tokens(12)
    cpu = sharpi.Session(path, exact=True)
    gpu = sharpi.Session(path, exact=True, device="cuda")
    # Every prompt row (the batched path) within the budget.
    want = np.asarray(cpu.decode(prompt, all_logits=True))
    got = np.asarray(gpu.decode(prompt, all_logits=True))
    assert got.shape == want.shape
    err = rel_err(got, want)
    assert err <= EXACT_BUDGET[quant], f"{arch} {quant}: prompt logits relative error {err:.2e}"
    for il, (g, c) in enumerate(zip(gpu.last_routing(), cpu.last_routing(), strict=True)):
        np.testing.assert_array_equal(g, c, err_msg=f"layer {il}: the device router chose other experts")
    # 32 greedy tokens (the one-token path): the same tokens, every step's logits within the budget.
    cpu_tokens, cpu_steps = greedy(cpu, prompt, N_GREEDY)
    gpu_tokens, gpu_steps = greedy(gpu, prompt, N_GREEDY)
    assert gpu_tokens == cpu_tokens
    worst = max(rel_err(g, c) for g, c in zip(gpu_steps, cpu_steps))
    record_property("prompt_rel_err", err)  # the measured margins (junit XML), for the budget notes above
    record_property("decode_rel_err", worst)
    assert worst <= EXACT_BUDGET[quant], f"{arch} {quant}: decode logits relative error {worst:.2e}"


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "fast"])
@pytest.mark.parametrize("quant", ["f32", "q8_0", "q4_k_m"])
@pytest.mark.parametrize("arch", E2E_ARCHES)
def test_gpu_prefill_equals_token_by_token(e2e_files, arch, quant, exact):
    path = e2e_files(arch, quant)
    # 300 tokens: two chunks of the device's 256-token batches.
    prompt = prompt_tokens(300, seed=7)
    gpu = sharpi.Session(path, exact=exact, device="cuda", n_ctx=512)
    batched = np.asarray(gpu.decode(prompt, all_logits=True)).reshape(len(prompt), -1)
    gpu.reset()
    one_by_one = np.stack([np.asarray(gpu.decode([t])) for t in prompt])
    bad = np.flatnonzero(bits(batched.astype(F32)) != bits(one_by_one.astype(F32)))
    assert bad.size == 0, f"{bad.size} logits differ, first at rows {np.unique(bad // batched.shape[1])[:8]}"
    # Without all_logits only the last chunk's last row goes through the output head: the same bits.
    gpu.reset()
    last = np.asarray(gpu.decode(prompt))
    np.testing.assert_array_equal(bits(last.astype(F32)), bits(batched[-1].astype(F32)))


@pytest.mark.parametrize("quant", ["q8_0", "q4_0", "q4_k_m", "q6_k"])
@pytest.mark.parametrize("arch", E2E_ARCHES)
def test_gpu_fast_mode_matches_cpu_fast_mode(e2e_files, arch, quant, record_property):
    # Held like test_fast_mode.py holds fast against exact on the CPU, per metric: a router near-tie
    # that one engine's rounding flips changes that position's expert set (tenths of the logit
    # scale), so the median position carries the rounding budget and the worst one a flip budget.
    path = e2e_files(arch, quant)
    tokens = prompt_tokens(48, seed=13)
    cpu = sharpi.Session(path, cache_type_k="f32", cache_type_v="f32")  # the device's KV type
    gpu = sharpi.Session(path, device="cuda")
    want = np.asarray(cpu.decode(tokens, all_logits=True), np.float64).reshape(len(tokens), -1)
    got = np.asarray(gpu.decode(tokens, all_logits=True), np.float64).reshape(len(tokens), -1)
    per_position = np.abs(got - want).max(axis=1) / np.abs(want).max()
    agreement = float((got.argmax(axis=1) == want.argmax(axis=1)).mean())
    what = f"{arch}/{quant}: median {np.median(per_position):.2e}, worst {per_position.max():.2e}, agreement {agreement:.3f}"
    record_property("fast_vs_cpu", what)
    assert np.median(per_position) <= FAST_MEDIAN_BUDGET, what
    assert per_position.max() <= FAST_WORST_BUDGET, what
    assert agreement >= FAST_AGREEMENT_MIN, what


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "fast"])
def test_gpu_reset_and_truncate_behave_as_on_the_cpu(e2e_files, exact):
    path = e2e_files("qwen3moe", "q4_k_m")
    a, b = prompt_tokens(10, seed=1), prompt_tokens(6, seed=2)
    gpu = sharpi.Session(path, exact=exact, device="cuda")
    first = np.asarray(gpu.decode(a + b, all_logits=True))
    assert gpu.n_past == len(a) + len(b)
    gpu.decode(prompt_tokens(5, seed=3))  # more positions, overwritten below
    gpu.reset()
    assert gpu.n_past == 0
    again = np.asarray(gpu.decode(a + b, all_logits=True))
    np.testing.assert_array_equal(bits(again.astype(F32)), bits(first.astype(F32)))
    # truncate: keep a, decode b again -> b's rows as before (positions past n_past are rewritten).
    gpu.decode(prompt_tokens(4, seed=4))
    gpu.truncate(len(a))
    rows_b = np.asarray(gpu.decode(b, all_logits=True)).reshape(len(b), -1)
    np.testing.assert_array_equal(bits(rows_b.astype(F32)), bits(first.reshape(len(a) + len(b), -1)[len(a):].astype(F32)))
    with pytest.raises(sharpi.ContextOverflowError):
        gpu.decode([1] * (gpu.info["n_ctx"] + 1))
    assert gpu.n_past == len(a) + len(b)  # a failed decode appends nothing


def test_gpu_session_refuses_a_quantized_kv_cache_before_allocating(e2e_files):
    path = e2e_files("olmoe", "f32")
    free_before = _internal.cuda_device_info()["vram_free"]
    with pytest.raises(sharpi.UnsupportedError, match="device KV cache is f32"):
        sharpi.Session(path, device="cuda", cache_type_k="q8_0")
    # Nothing of the refused session stays on the device (allow another process's small drift).
    assert _internal.cuda_device_info()["vram_free"] >= free_before - (16 << 20)


def test_gpu_session_too_big_for_vram_is_an_invalid_argument_naming_the_sizes(e2e_files):
    path = e2e_files("qwen3moe", "f32")
    n_ctx_train = 4096  # the tiny preset's
    # A KV cache larger than the device: n_ctx far beyond the trained context (allowed explicitly).
    free = _internal.cuda_device_info()["vram_free"]
    plan = _internal.cuda_device_plan(path, 1024)
    per_pos = plan["kv_bytes"] // 1024
    n_ctx = int(free // per_pos) + 1024
    assert n_ctx > n_ctx_train
    with pytest.raises(sharpi.InvalidArgument, match=r"MiB do not fit the \d+ MiB free on"):
        sharpi.Session(path, device="cuda", n_ctx=n_ctx, allow_long_context=True)


def test_gpu_cancel_appends_nothing_and_the_session_goes_on(e2e_files):
    path = e2e_files("qwen2moe", "q8_0")
    prompt = prompt_tokens(20, seed=21)
    gpu = sharpi.Session(path, exact=True, device="cuda")
    want = np.asarray(gpu.decode(prompt))
    gpu.reset()
    gpu.cancel()  # seen by the next decode at its first layer
    with pytest.raises(sharpi.CancelledError):
        gpu.decode(prompt)
    assert gpu.n_past == 0
    np.testing.assert_array_equal(bits(np.asarray(gpu.decode(prompt)).astype(F32)), bits(want.astype(F32)))
