"""cpu::expert_ffn_one_token (the fused decode FFN of one token's routed experts) and
cpu::expert_ffn_batch (the grouped prefill FFN of several experts over their own tokens) against the
unfused one-token composition of the engine's ops (bit for bit, both modes, any thread count) and
against float64 numpy on the gguf package's dequantized weights (exact mode to f32 rounding, fast mode
to the 8-bit activation budget). Fresh random weights and inputs each run."""

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from sharpi import _internal
from test_quant import oracle_dequantize, random_rows

# (gate/up type, down type) per slot: a Q4_K_M-like mix, Q8_0, a 32-element min type, plain f32.
SLOT_TYPES = [(Q.Q4_K, Q.Q6_K), (Q.Q8_0, Q.Q8_0), (Q.Q5_K, Q.Q4_1), (Q.F32, Q.F16)]
N_EMBD, N_FF = 512, 256


@pytest.fixture
def rng():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def make_experts(rng, slot_types=SLOT_TYPES):
    experts, dense = [], []
    for gate_type, down_type in slot_types:
        g = random_rows(gate_type, N_FF, N_EMBD, rng)
        u = random_rows(gate_type, N_FF, N_EMBD, rng)
        d = random_rows(down_type, N_EMBD, N_FF, rng)
        experts.append((int(gate_type), g, int(gate_type), u, int(down_type), d))
        dense.append(
            (
                oracle_dequantize(gate_type, g, N_FF, N_EMBD).astype(np.float64),
                oracle_dequantize(gate_type, u, N_FF, N_EMBD).astype(np.float64),
                oracle_dequantize(down_type, d, N_EMBD, N_FF).astype(np.float64),
            )
        )
    return experts, dense


def reference(dense, weights, x):
    out = np.zeros(N_EMBD)
    for (g, u, d), w in zip(dense, weights):
        a = g @ x
        out += w * (d @ (a / (1 + np.exp(-a)) * (u @ x)))
    return out


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "fast"])
def test_fused_equals_unfused_and_reference(exact, rng):
    experts, dense = make_experts(rng)
    weights = rng.dirichlet(np.ones(len(experts))).astype(np.float32)
    # random_rows scales reach |w| ~ 10 (Q8_0): small x keeps the gate in SiLU's interesting range.
    x = (0.01 * rng.standard_normal(N_EMBD)).astype(np.float32)
    unfused = _internal.expert_ffn(experts, weights, x, N_FF, threads=1, exact=exact, fused=False)
    for threads in (1, 2, 3):
        fused = _internal.expert_ffn(experts, weights, x, N_FF, threads=threads, exact=exact, fused=True)
        np.testing.assert_array_equal(
            fused.view(np.uint32), unfused.view(np.uint32), err_msg=f"threads={threads}"
        )
    assert np.isfinite(unfused).all()
    want = reference(dense, weights.astype(np.float64), x.astype(np.float64))
    rel = np.abs(unfused - want).max() / np.abs(want).max()
    # Exact: f32 sums of a few hundred products (measured 1.5e-7 .. 2.4e-7 over 5 seeds). Fast: 8-bit
    # activations into both layers, the down input heavy-tailed (silu(g) * u): measured 1.0e-2 .. 2.3e-2.
    assert rel <= (1e-5 if exact else 6e-2), rel


def test_repeated_expert_and_single_slot(rng):
    experts, _ = make_experts(rng)
    x = rng.standard_normal(N_EMBD).astype(np.float32)
    one = _internal.expert_ffn(experts[:1], np.ones(1, np.float32), x, N_FF, threads=2)
    twice = _internal.expert_ffn([experts[0], experts[0]], np.array([0.25, 0.75], np.float32), x, N_FF, threads=2)
    np.testing.assert_array_equal(twice, np.float32(0.25) * one + np.float32(0.75) * one)


# Layer-like expert sets for the grouped prefill op: the fast path needs one type per projection
# across the experts (as in a layer); the mixed set takes the expert-by-expert fallback.
BATCH_SETS = {
    "q4_k_m": [(Q.Q4_K, Q.Q6_K)] * 5,
    "q8_0": [(Q.Q8_0, Q.Q8_0)] * 5,
    "q5_k_q4_1": [(Q.Q5_K, Q.Q4_1)] * 5,
    "mixed": SLOT_TYPES,
}


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "fast"])
@pytest.mark.parametrize("types", BATCH_SETS.keys())
def test_batch_equals_one_token_composition(types, exact, rng):
    experts, dense = make_experts(rng, BATCH_SETS[types])
    n_tokens = 40
    x = (0.01 * rng.standard_normal((n_tokens, N_EMBD))).astype(np.float32)
    # Member counts around the 8-token tile (tails of 1..7, one expert with none), random tokens.
    counts = [1, 0, 9, 17, 40, 7][: len(experts)]
    members = [np.sort(rng.choice(n_tokens, size=c, replace=False)).astype(np.int64) for c in counts]
    got = {
        threads: _internal.expert_ffn_batch(experts, members, x, N_FF, threads=threads, exact=exact)
        for threads in (1, 2, 3)
    }
    assert got[1].shape == (sum(counts), N_EMBD)
    row = 0
    for e, toks in enumerate(members):
        for t in toks:
            # One token through the unfused decode composition (router weight 1: y exactly).
            want = _internal.expert_ffn(
                [experts[e]], np.ones(1, np.float32), x[t], N_FF, threads=1, exact=exact, fused=False
            )
            for threads, y in got.items():
                np.testing.assert_array_equal(
                    y[row].view(np.uint32),
                    want.view(np.uint32),
                    err_msg=f"expert {e} token {t} threads {threads}",
                )
            g, u, d = dense[e]
            a = g @ x[t].astype(np.float64)
            ref = d @ (a / (1 + np.exp(-a)) * (u @ x[t].astype(np.float64)))
            rel = np.abs(got[1][row] - ref).max() / np.abs(ref).max()
            # Same budgets as test_fused_equals_unfused_and_reference (one expert instead of four).
            assert rel <= (1e-5 if exact else 6e-2), (e, t, rel)
            row += 1
