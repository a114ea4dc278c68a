"""Fast mode (the default: activations quantized to q8_K / q8_0 / q8_1 and dotted in integers, as
llama.cpp does) against exact mode (f32 activations, dequantized weights) on whole models.

Exact mode is the oracle here: it is held to the float64 reference and to transformers in
test_model_vs_reference.py / test_model_vs_transformers.py / test_shipped_model.py. Fast mode differs from it by
8-bit activation rounding (~1e-2 relative per logit), and on small random MoE models by router
near-ties that the rounding flips (a different expert set: tenths of the logit scale at that
position), as docs/design.md §8 and the issue note for llama.cpp. So the budgets below are per metric:

- median over positions of max|fast - exact| / max|exact| (the rounding itself),
- the worst position (router flips included),
- teacher-forced top-1 agreement: both modes read the same token sequence, and the greedy choice
  must agree at most positions (one flip no longer forks a free-running greedy path, so this is
  the greedy agreement that can be asserted on random models; the trained shipped model is also
  held to identical free-running greedy tokens).

Measured (this machine, 10 random 48-token sequences per case, 4 MoE archs x 12 quantized types,
tiny preset, seed 11; re-measured after the fast-mode attention kernels, see MEDIAN_BUDGET):
median <= 2.0e-2, worst position <= 0.47, agreement >= 0.896 (mean 0.948 to 0.987); dense models (no router): worst position <= 1.7e-2. Fresh random token sequences each run.

Also: the lossless invariants hold inside fast mode (prefill == token-by-token decode, streamed ==
resident, bit for bit), exact=True and SHARPI_EXACT=1 select the same (exact) arithmetic, and
F32 / F16 files, which have no integer kernels, differ between the modes only by fast attention's
f32 rounding order (cpu/ops/attention.h; measured <= 4.0e-7 relative, 8 sequences x 3 types).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sharpi
from sharpi.make_model import write_model

MOE_ARCHS = ["llama", "qwen2moe", "qwen3moe", "olmoe", "deepseek2", "glm4moe", "minimax-m2", "deepseek4"]
QUANT_TYPES = [
    "q8_0",
    "q4_0",
    "q4_1",
    "q5_0",
    "q5_1",
    "q2_k",
    "q3_k",
    "q4_k",
    "q5_k",
    "q6_k",
    "q4_k_m",
    "q5_k_m",
]
PLAIN_TYPES = ["f32", "f16", "bf16"]

# Median over positions, fresh random prompts each run. Measured 2026-11-28 (after the fast-mode
# attention kernels): the highest median over 300 random prompts per quant type is 3.1e-2 for deepseek2
# (q4_k, q2_k; p90 2.6e-2) and over 100 prompts 2.8e-2 for llama, 2.4e-2 qwen3moe, 1.6e-2 qwen2moe
# and olmoe; the earlier budget 3e-2 failed a CI run (deepseek2/q3_k, 3.07e-2). A broken kernel is off by O(1).
MEDIAN_BUDGET = 4e-2
WORST_BUDGET = 0.6  # measured <= 0.47 (router flips)
AGREEMENT_MIN = 0.85  # measured >= 0.896
# deepseek2's tiny model routes group-limited (top groups first, then top-k inside them), which adds
# near-ties that a quantized activation flips: measured over 25 random prompts each of q2_k, q3_k and
# q4_k, agreement min 0.833, 10th percentile 0.883, median 0.9375 (qwen3moe: min 0.896, olmoe 0.9375).
# Over 300 random prompts x 12 quant types (2026-11-28) deepseek2's lowest agreement was 0.771 (11 of 48
# tokens flipped): the floor leaves two more flips. llama (the tiny Mixtral-style MoE) gave 0.833 (40 of
# 48) on q5_k in CI (2026-12-07); re-measured then over 150 random prompts x 12 quant types: lowest
# 0.833 (q2_k), 1st percentile 0.875 to 0.917, mean 0.963 to 0.977: its floor also leaves two more flips.
# glm4moe (tiny: sigmoid routing with a selection bias over 2 of 8 experts, plus a shared expert),
# measured 2026-12-07 over 150 random prompts x 12 quant types: lowest agreement 0.833 (q3_k), 1st
# percentile 0.854 to 0.896; highest median 2.7e-2, worst position 0.49. Its floor leaves two more flips.
# minimax-m2 (tiny: whole-projection q/k norms, sigmoid routing with a selection bias over 2 of 8
# experts), measured 2026-12-07 over 450 random prompts x 12 quant types: lowest agreement 0.812
# (q3_k, q2_k, q5_k_m; 39 of 48), 1st percentile 0.854 to 0.906; highest median 2.8e-2, worst
# position 0.54. Its floor leaves two more flips.
# deepseek4 (tiny: an indexer keeping 2 of up to 12 compressed entries, a hash-routed layer,
# 4 hyper-connection streams), measured 2026-12-07 over 40 random prompts x 12 quant types: lowest
# agreement 0.6875 (q4_0; 33 of 48), mean 0.876 to 0.916; highest median 6.1e-2 (q5_k_m), worst
# position 0.87 (q2_k). The mean median is ~2e-2 as elsewhere (measured over 15 q8_0 prompts); the
# tails are the indexer's top-2 and the router flipping on quantized activations (with the indexer
# keeping every entry the highest median drops from 3.5e-2 to 2.7e-2). F32 / F16 / BF16 files give
# exact mode's bits. Its budgets leave two more flips.
AGREEMENT_MIN_BY_ARCH = {"deepseek2": 0.70, "llama": 0.79, "glm4moe": 0.79, "minimax-m2": 0.77, "deepseek4": 0.64}
MEDIAN_BUDGET_BY_ARCH = {"deepseek4": 8e-2}
WORST_BUDGET_BY_ARCH = {"deepseek4": 1.0}
DENSE_WORST_BUDGET = 5e-2  # measured <= 1.7e-2

N_TOKENS = 48
REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "python" / "sharpi" / "models" / "stdlib-moe-q8_0.gguf"
DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture
def rng(request):
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("fast_mode_models")
    cache = {}

    def get(arch, quant, **overrides):
        key = (arch, quant, tuple(sorted(overrides.items())))
        if key not in cache:
            path = str(d / f"{arch}-{quant}-{len(cache)}.gguf")
            write_model(path, arch=arch, preset="tiny", quant=quant, seed=11, **overrides)
            cache[key] = path
        return cache[key]

    return get


def compare(path, tokens, **fast_options):
    exact = sharpi.Session(path, threads=2, exact=True).decode(tokens, all_logits=True)
    fast = sharpi.Session(path, threads=2, exact=False, **fast_options).decode(tokens, all_logits=True)
    per_position = np.abs(fast - exact).max(axis=1) / np.abs(exact).max()
    agreement = float((fast.argmax(axis=1) == exact.argmax(axis=1)).mean())
    return exact, fast, per_position, agreement


@pytest.mark.parametrize("quant", QUANT_TYPES)
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_fast_mode_within_budget_of_exact(arch, quant, model, rng):
    path = model(arch, quant)
    n_vocab = sharpi.Session(path, threads=1, n_ctx=8).info["n_vocab"]
    tokens = rng.integers(0, n_vocab, size=N_TOKENS).tolist()
    exact, fast, per_position, agreement = compare(path, tokens)
    assert np.isfinite(fast).all()
    assert not np.array_equal(fast, exact), "fast mode gave exact mode's bits: are activations quantized?"
    what = f"{arch}/{quant}: median {np.median(per_position):.2e}, worst {per_position.max():.2e}, agreement {agreement:.3f}"
    assert np.median(per_position) <= MEDIAN_BUDGET_BY_ARCH.get(arch, MEDIAN_BUDGET), what
    assert per_position.max() <= WORST_BUDGET_BY_ARCH.get(arch, WORST_BUDGET), what
    assert agreement >= AGREEMENT_MIN_BY_ARCH.get(arch, AGREEMENT_MIN), what


@pytest.mark.parametrize("arch, overrides", [("llama", {"n_expert": 0}), ("qwen2", {}), ("qwen3", {})])
@pytest.mark.parametrize("quant", ["q8_0", "q4_k_m"])
def test_fast_mode_dense_models(arch, overrides, quant, model, rng):
    # No router, so no flips: every position is held to the rounding budget.
    path = model(arch, quant, **overrides)
    n_vocab = sharpi.Session(path, threads=1, n_ctx=8).info["n_vocab"]
    _, _, per_position, _agreement = compare(path, rng.integers(0, n_vocab, size=N_TOKENS).tolist())
    assert per_position.max() <= DENSE_WORST_BUDGET, f"{arch}/{quant}: worst {per_position.max():.2e}"


@pytest.mark.parametrize("quant", PLAIN_TYPES)
def test_plain_float_files_differ_only_by_attention_rounding(quant, model, rng):
    path = model("qwen3moe", quant)
    # Fast mode's default f16 KV cache would be a second difference: keep it f32 here. What is left
    # is attention's block kernels (same math, another f32 rounding order): measured <= 4.0e-7.
    _, _, per_position, agreement = compare(path, rng.integers(0, 256, size=12).tolist(), cache_type_k="f32",
                                            cache_type_v="f32")
    assert per_position.max() <= 2e-6, per_position.max()
    assert agreement == 1.0


@pytest.mark.parametrize("quant", ["q4_k_m", "q8_0", "q5_1"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_fast_prefill_equals_token_by_token(arch, quant, model, rng):
    path = model(arch, quant)
    s = sharpi.Session(path, threads=2)
    tokens = rng.integers(0, s.info["n_vocab"], size=20).tolist()
    batch = s.decode(tokens, all_logits=True)
    s.reset()
    steps = np.stack([s.decode([t]) for t in tokens])
    np.testing.assert_array_equal(batch, steps)


def test_fast_streamed_equals_resident(model, rng):
    path = model("olmoe", "q4_k_m")
    resident = sharpi.Session(path, threads=2, n_ctx=128)
    tokens = rng.integers(0, resident.info["n_vocab"], size=10).tolist()
    want = resident.decode(tokens, all_logits=True)
    st = sharpi.Session(path, n_ctx=128, ram_budget="1GiB").expert_stats()
    k = resident.info["n_expert_used"]
    for predictor, extra in (("none", 0), ("prev_token", k)):
        budget = st["fixed_bytes"] + (k + 1 + extra) * st["slot_bytes"]  # a cache that must evict
        streamed = sharpi.Session(path, threads=2, n_ctx=128, ram_budget=budget, predictor=predictor)
        got = streamed.decode(tokens[:4], all_logits=True)
        got = np.concatenate([got] + [streamed.decode([t])[None] for t in tokens[4:]])
        np.testing.assert_array_equal(got, want, err_msg=f"predictor {predictor}")


_PRINT_LOGITS = (
    "import sys, numpy as np, sharpi\n"
    "s = sharpi.Session(sys.argv[1], threads=2, exact=sys.argv[3] == '1')\n"
    "np.save(sys.argv[2], s.decode([3, 1, 4, 1, 5, 9, 2, 6], all_logits=True))\n"
)


def test_sharpi_exact_env_selects_exact_mode(model, tmp_path):
    path = model("qwen2moe", "q4_k_m")
    out = {}
    for name, env_value, exact_arg in (
        ("env", "1", "0"),
        ("arg", None, "1"),
        ("fast", None, "0"),
        ("env0", "0", "0"),
    ):
        env = dict(os.environ)
        env.pop("SHARPI_EXACT", None)
        if env_value is not None:
            env["SHARPI_EXACT"] = env_value
        f = str(tmp_path / f"{name}.npy")
        subprocess.run([sys.executable, "-c", _PRINT_LOGITS, path, f, exact_arg], check=True, env=env)
        out[name] = np.load(f)
    np.testing.assert_array_equal(out["env"], out["arg"])
    np.testing.assert_array_equal(out["env0"], out["fast"])
    assert not np.array_equal(out["fast"], out["arg"])


def test_two_sessions_in_one_process_keep_their_modes(model):
    path = model("olmoe", "q8_0")
    tokens = [5, 7, 11, 13]
    exact = sharpi.Session(path, threads=2, exact=True)
    fast = sharpi.Session(path, threads=2)
    a = exact.decode(tokens, all_logits=True)
    b = fast.decode(tokens, all_logits=True)
    np.testing.assert_array_equal(
        exact.decode([17]),
        sharpi.Session(path, threads=2, exact=True).decode(tokens + [17], all_logits=True)[-1:][0],
    )
    np.testing.assert_array_equal(
        a, sharpi.Session(path, threads=1, exact=True).decode(tokens, all_logits=True)
    )
    np.testing.assert_array_equal(b, sharpi.Session(path, threads=1).decode(tokens, all_logits=True))
    assert not np.array_equal(a, b)


# ---- the shipped trained model ----------------------------------------------------------------------


def test_shipped_model_fast_mode_greedy_and_agreement(rng):
    """Same 16 greedy tokens on each of the 4 test prompts (the held-out prompts of
    test_shipped_model.py), and >= 95% teacher-forced top-1 agreement over 256 positions of held-out
    text at a random offset. Measured: 16/16 on all 4 prompts; agreement 0.984 to 1.0 at offsets
    0, 40000, 80000."""
    trace = np.load(DATA / "stdlib_moe_trace.npz")
    exact = sharpi.Session(str(SHIPPED), threads=2, exact=True)
    fast = sharpi.Session(str(SHIPPED), threads=2)
    for start in trace["seq_start"][:4]:
        prompt = trace["tokens"][start : start + 32].astype(np.int64).tolist()
        paths = []
        for s in (exact, fast):
            s.reset()
            logits, tokens = s.decode(prompt), []
            for _ in range(16):
                tokens.append(int(np.argmax(logits)))
                logits = s.decode([tokens[-1]])
            paths.append(tokens)
        assert paths[1] == paths[0], f"prompt at {start}: fast {paths[1]} vs exact {paths[0]}"

    heldout = np.load(DATA / "stdlib_moe_heldout_tokens.npz")["tokens"]
    offset = int(rng.integers(0, len(heldout) - 257))
    seq = heldout[offset : offset + 257].astype(np.int64).tolist()
    exact.reset()
    fast.reset()
    a = exact.decode(seq, all_logits=True)[:256].argmax(axis=1)
    b = fast.decode(seq, all_logits=True)[:256].argmax(axis=1)
    agreement = float((a == b).mean())
    assert agreement >= 0.95, f"offset {offset}: top-1 agreement {agreement:.3f}"
