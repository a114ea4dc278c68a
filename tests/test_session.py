"""Engine-level properties of sharpi.Session on small synthetic models.

The oracles here are the engine's own other paths, chosen so that a bug in one path cannot hide
in the other: prefill (one batch) vs token-by-token decoding, 1 vs 2 threads, fresh session vs
reset(), scalar vs SIMD kernels. Numerical agreement with independent references (float64 numpy,
transformers) lives in test_model_vs_*.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import sharpi
from sharpi.make_model import write_model

ARCHS = ["llama", "qwen2moe", "qwen3moe", "olmoe"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("session_models")
    out = {}
    for arch in ARCHS:
        for quant in ("f32", "q4_k_m"):
            path = str(d / f"{arch}-{quant}.gguf")
            write_model(path, arch=arch, preset="tiny", quant=quant, seed=7)
            out[(arch, quant)] = path
    return out


def prompt_for(session, n=12, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, session.info["n_vocab"], size=n).tolist()


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "fast"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("quant", ["f32", "q4_k_m"])
def test_prefill_equals_token_by_token(models, arch, quant, exact):
    # Every builder computes a token's row identically whatever the batch size, and the kernels
    # guarantee dot_row == dot_f32(dequant_row) (exact mode) and vec_dot_tile == vec_dot per token
    # (fast mode), so the logits must agree bit for bit in both modes.
    s = sharpi.Session(models[(arch, quant)], threads=2, exact=exact)
    tokens = prompt_for(s)
    batch = s.decode(tokens, all_logits=True)
    s.reset()
    steps = np.stack([s.decode([t]) for t in tokens])
    assert batch.shape == (len(tokens), s.info["n_vocab"])
    assert np.isfinite(batch).all()
    np.testing.assert_array_equal(batch, steps)


@pytest.mark.parametrize("arch", ARCHS)
def test_thread_count_does_not_change_logits(models, arch):
    path = models[(arch, "q4_k_m")]
    results = []
    for threads in (1, 2, 3):
        s = sharpi.Session(path, threads=threads)
        results.append(s.decode(prompt_for(s), all_logits=True))
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], results[2])


def test_reset_and_last_logits(models):
    s = sharpi.Session(models[("qwen3moe", "f32")], threads=2)
    tokens = prompt_for(s)
    all_rows = s.decode(tokens, all_logits=True)
    assert s.n_past == len(tokens)
    s.reset()
    assert s.n_past == 0
    last = s.decode(tokens)
    np.testing.assert_array_equal(last, all_rows[-1])
    # Continuing after a prefill equals one longer prefill.
    more = prompt_for(s, n=5, seed=1)
    cont = s.decode(more, all_logits=True)
    s.reset()
    joint = s.decode(tokens + more, all_logits=True)
    np.testing.assert_array_equal(cont, joint[len(tokens):])


def test_long_prefill_spans_batches(models):
    # decode() splits long inputs into chunks of 256 tokens; the chunk boundary must be invisible.
    s = sharpi.Session(models[("olmoe", "q4_k_m")], threads=2, n_ctx=600)
    tokens = prompt_for(s, n=300, seed=3)
    batch = s.decode(tokens, all_logits=True)
    s.reset()
    first = s.decode(tokens[:250], all_logits=True)
    second = s.decode(tokens[250:], all_logits=True)
    np.testing.assert_array_equal(batch, np.concatenate([first, second]))


def test_context_overflow_is_typed_and_harmless(models):
    s = sharpi.Session(models[("llama", "f32")], threads=1, n_ctx=16)
    assert s.info["n_ctx"] == 16
    tokens = prompt_for(s, n=10)
    ref = s.decode(tokens)
    with pytest.raises(sharpi.ContextOverflowError, match="exceed the context of 16"):
        s.decode(prompt_for(s, n=7, seed=5))
    assert s.n_past == 10  # nothing appended
    nxt = s.decode([3])
    s.reset()
    s.decode(tokens)
    np.testing.assert_array_equal(nxt, s.decode([3]))
    del ref


def test_invalid_tokens_and_options(models):
    path = models[("llama", "f32")]
    s = sharpi.Session(path, threads=1)
    n_vocab = s.info["n_vocab"]
    with pytest.raises(sharpi.InvalidArgument, match="outside the vocabulary"):
        s.decode([1, n_vocab])
    with pytest.raises(sharpi.InvalidArgument, match="outside the vocabulary"):
        s.decode([-1])
    with pytest.raises(sharpi.InvalidArgument, match="no tokens"):
        s.decode([])
    assert s.n_past == 0
    with pytest.raises(sharpi.InvalidArgument, match="n_ctx"):
        sharpi.Session(path, n_ctx=-5)
    with pytest.raises(sharpi.InvalidArgument, match="threads"):
        sharpi.Session(path, threads=-1)


def test_dump_names_every_layer(models):
    s = sharpi.Session(models[("qwen2moe", "f32")], threads=2, dump_activations=True)
    tokens = prompt_for(s, n=4)
    logits = s.decode(tokens, all_logits=True)
    d = s.dump()
    n_layer = s.info["n_layer"]
    for il in range(n_layer):
        for name in ("attn_norm", "Qcur", "kqv_out", "attn_out", "ffn_inp", "ffn_moe_probs", "ffn_moe_out",
                     "ffn_shexp", "ffn_out", "l_out"):
            assert f"{name}-{il}" in d, f"{name}-{il} missing from dump"
    assert d["l_out-0"].shape == (4, s.info["n_embd"])
    np.testing.assert_array_equal(d["result_output"], logits)
    # probabilities of the router sum to 1 per token
    np.testing.assert_allclose(d["ffn_moe_probs-0"].sum(axis=1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("isa", ["scalar", "avx2"])
def test_simd_and_scalar_kernels_agree(models, isa):
    path = models[("qwen3moe", "q4_k_m")]
    code = (
        "import sys, numpy as np, sharpi\n"
        # Exact mode: the f32 kernels' summation orders differ per ISA (the fast kernels give the
        # same bits on every ISA, test_qdot.py), and this bound is for f32 rounding.
        "s = sharpi.Session(sys.argv[1], threads=2, exact=True)\n"
        "np.save(sys.argv[2], s.decode(list(range(3, 15)), all_logits=True))\n"
    )
    outs = {}
    for name, env_isa in (("best", None), (isa, isa)):
        env = dict(os.environ)
        env.pop("SHARPI_ISA", None)
        if env_isa:
            env["SHARPI_ISA"] = env_isa
        out = path + f".{name}.npy"
        subprocess.run([sys.executable, "-c", code, path, out], check=True, env=env)
        outs[name] = np.load(out)
    # Different summation orders only: f32 rounding, relative to the logit scale.
    scale = np.abs(outs["best"]).max()
    np.testing.assert_allclose(outs[isa], outs["best"], rtol=0, atol=2e-5 * scale)


def test_generate_streams_text(models):
    s = sharpi.Session(models[("qwen3moe", "q4_k_m")], threads=2)
    pieces = list(s.generate("def f(x):", max_tokens=12, temperature=0.0, stop_at_eos=False))
    text = "".join(pieces)
    assert s.last_stats["n_generated"] == 12
    prompt_ids = s.tokenize("def f(x):")
    assert s.n_past == len(prompt_ids) + 11  # the last sampled token is not decoded
    # Greedy generation is argmax of the logits at every step: replay it with decode().
    s.reset()
    logits = s.decode(prompt_ids)
    ids = []
    for _ in range(12):
        ids.append(int(np.argmax(logits)))
        logits = s.decode([ids[-1]])
    assert text == s.tokenizer.decode(ids, skip_special=True)


def test_name_and_file_shorthands_are_checked_in_cpp(tmp_path):
    """predictor / cache_policy "NAME:FILE" are resolved and checked by the C++ options
    (resolve_session_options), before the model file is opened: a missing model still gets the
    option's InvalidArgument, through sharpi.Session and through the bare core alike."""
    from sharpi import _core

    missing = str(tmp_path / "absent.gguf")
    with pytest.raises(sharpi.InvalidArgument, match="predictor file given twice: 'a.gguf' and 'b.gguf'"):
        sharpi.Session(missing, predictor="cooc:a.gguf", predictor_file="b.gguf")
    with pytest.raises(sharpi.InvalidArgument, match="predictor file given twice: 'a.gguf' and 'b.gguf'"):
        _core.Session(missing, predictor="cooc:a.gguf", predictor_file="b.gguf")
    with pytest.raises(sharpi.InvalidArgument, match="cache policy file given twice: 'p1' and 'p2'"):
        _core.Session(missing, cache_policy="prior:p1", cache_policy_file="p2")
    # The same file named twice, or once: the options pass and opening the model fails.
    with pytest.raises(sharpi.IoError, match="absent.gguf"):
        sharpi.Session(missing, predictor="cooc:a.gguf", predictor_file="a.gguf")
    with pytest.raises(sharpi.IoError, match="absent.gguf"):
        sharpi.Session(missing, cache_policy="prior:p1")
