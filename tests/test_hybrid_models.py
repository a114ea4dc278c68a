"""The hybrid Gated DeltaNet archs (qwen3next, qwen35moe) on files written by llama.cpp's converter
from tiny random Hugging Face models (tests/reference/hf_export.py), beyond the logits checks of
test_model_vs_transformers.py: the per-sequence recurrent state (reset() clears it, a decode
continues it), the nextn (MTP) block the converter writes (loaded, reported by inspect, not run),
and streaming under a 25% expert budget with prev_token, next_gate, cooc and trajectory (random
sidecars: losslessness must not depend on hint quality) and a Python plug-in,
bit-identical to resident (the oracle: the resident engine, itself held to transformers).

Skips (never fails) without torch/transformers or when the converter cannot be fetched.
"""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5.0")

import sharpi
from reference import hf_export
from reference.engine_checks import greedy_logits
from sharpi.inspect_model import inspect_summary

NAMES = sorted(hf_export.HYBRID_MODELS)
PROMPT = hf_export.random_prompt(384, 12, seed=99)


@pytest.fixture(scope="module")
def files(model_dir):
    try:
        converter = hf_export.converter_dir()
    except hf_export.ConverterUnavailable as error:
        pytest.skip(f"llama.cpp converter unavailable: {error}")
    return {name: str(hf_export.prepare(name, model_dir, converter, outtypes=("f32",)).gguf["f32"]) for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_nextn_block_is_loaded_and_reported(files, name):
    s = sharpi.Session(files[name], threads=1, n_ctx=64)
    assert s.info["n_layer"] == 4  # the trunk; block_count is 5 with the MTP block
    summary = inspect_summary(files[name])
    assert summary["nextn"]["n_layer"] == 1 and summary["nextn"]["blocks"] == [4]
    assert summary["nextn"]["tensors"] > 10
    assert summary["layer_kinds"] == "RARA"


@pytest.mark.parametrize("name", NAMES)
def test_reset_clears_the_recurrent_state(files, name):
    s = sharpi.Session(files[name], threads=2, n_ctx=64)
    first = np.asarray(s.decode(PROMPT, True))
    continued = np.asarray(s.decode(PROMPT[:3]))  # continues the sequence: state and KV carried
    s.reset()
    again = np.asarray(s.decode(PROMPT, True))
    np.testing.assert_array_equal(again, first)
    # Continuing after PROMPT is not starting over: the state and the KV cache carried over.
    fresh = np.asarray(sharpi.Session(files[name], threads=2, n_ctx=64).decode(PROMPT[:3]))
    assert not np.array_equal(continued, fresh)


class _Echo(sharpi.Predictor):
    """Hints the current layer's top experts for the next layer: any hints at all exercise prefetch."""

    def observe(self, layer, hidden, router_logits, history, prev):
        top = np.argsort(-np.asarray(router_logits))[:2]
        return [(layer + 1, int(e), 1.0) for e in top] if layer + 1 < 4 else []


def _sidecar(kind: str, path) -> str:
    """A predictor sidecar of the tiny hybrids' routing shape (4 layers, 8 experts, top-2) with random
    weights: losslessness must not depend on how good the hints are."""
    import torch
    from sharpi.predict import sidecar as scm
    from sharpi.predict import train

    if kind == "cooc":
        rng = np.random.default_rng(0)
        tensors = {
            "cooc.bias": rng.standard_normal((4, 8)).astype(np.float32),
            "cooc.layer": rng.standard_normal((4, 3, 8, 8)).astype(np.float32),
            "cooc.prev": rng.standard_normal((4, 8, 8)).astype(np.float32),
        }
        sc = scm.Sidecar("cooc", 4, 8, 2, 2, "test", {"cooc.history": 2}, tensors)
    else:
        torch.manual_seed(0)
        net = train.make_trajectory_module(torch, 4, 8, d_model=16, n_block=1, n_head=2, d_ff=32,
                                           max_lookahead=2, window=3)  # fmt: skip
        sc = scm.Sidecar("trajectory", 4, 8, 2, 2, "test", dict(net.hparams), net.sidecar_tensors())
    scm.write_sidecar(path, sc)
    return str(path)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("predictor", ["none", "prev_token", "next_gate", "cooc", "trajectory", "custom"])
def test_streamed_at_quarter_budget_is_bit_identical(files, name, predictor, tmp_path):
    path = files[name]
    extra = {}
    if predictor in ("cooc", "trajectory"):
        extra["predictor_file"] = _sidecar(predictor, tmp_path / f"{predictor}.gguf")
    resident = greedy_logits(sharpi.Session(path, threads=2, n_ctx=64), PROMPT, 12)
    probe = sharpi.Session(path, threads=1, n_ctx=64, ram_budget="4GiB", reader="pread")
    st, info = probe.expert_stats(), probe.info
    total = info["n_layer"] * info["n_expert"]
    k = info["n_expert_used"]
    n_slots = max(k, total // 4)
    staging = 0 if predictor == "none" else k  # lookahead 1
    budget = st["fixed_bytes"] + (n_slots + staging) * st["slot_bytes"]
    chosen = _Echo() if predictor == "custom" else predictor
    s = sharpi.Session(
        path, threads=2, n_ctx=64, ram_budget=budget, reader="pread", predictor=chosen, lookahead=1, **extra
    )
    assert s.expert_stats()["n_slots"] <= total // 4 + 1
    np.testing.assert_array_equal(greedy_logits(s, PROMPT, 12), resident)
    if predictor != "none":
        assert sum(lay["prefetch_issued"] for lay in s.expert_stats()["layers"]) > 0


def _legacy_ssm_in_file(src: str, dst: str) -> None:
    """The qwen3next file as older converters wrote it: attn_qkv + attn_gate replaced by one ssm_in
    projection whose rows are, per key head g, [q_g, k_g, v of its value heads, z of them] (HF's
    in_proj_qkvz order, which llama.cpp still reads)."""
    from gguf import GGUFReader
    from model_files import rewrite_gguf

    reader = GGUFReader(src)
    md = {k: f.contents() for k, f in reader.fields.items() if k.startswith("qwen3next.ssm.")}
    nk, dk = md["qwen3next.ssm.group_count"], md["qwen3next.ssm.state_size"]
    vg = md["qwen3next.ssm.inner_size"] // nk
    arrays = {t.name: np.asarray(t.data, dtype=np.float32) for t in reader.tensors}
    drop, add = [], {}
    for il in range(4):
        qkv_name = f"blk.{il}.attn_qkv.weight"
        if qkv_name not in arrays:
            continue
        qkv, z = arrays[qkv_name], arrays[f"blk.{il}.attn_gate.weight"]  # numpy [rows, n_embd]
        key_dim = nk * dk
        rows = []
        for g in range(nk):
            rows += [qkv[g * dk : (g + 1) * dk], qkv[key_dim + g * dk : key_dim + (g + 1) * dk]]
            rows += [qkv[2 * key_dim + g * vg : 2 * key_dim + (g + 1) * vg], z[g * vg : (g + 1) * vg]]
        drop += [qkv_name, f"blk.{il}.attn_gate.weight"]
        add[f"blk.{il}.ssm_in.weight"] = np.concatenate(rows)
    rewrite_gguf(src, dst, drop_tensors=tuple(drop), add_tensors=add)


def test_older_qwen3next_files_with_ssm_in(files, tmp_path):
    legacy = str(tmp_path / "qwen3next-ssm_in.gguf")
    _legacy_ssm_in_file(files["qwen3next"], legacy)
    want = sharpi.Session(files["qwen3next"], threads=2, n_ctx=64, exact=True).decode(PROMPT, True)
    got = sharpi.Session(legacy, threads=2, n_ctx=64, exact=True).decode(PROMPT, True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)
    # Neither form present: a typed error naming both.
    broken = str(tmp_path / "qwen3next-no-qkv.gguf")
    from model_files import rewrite_gguf

    rewrite_gguf(files["qwen3next"], broken, drop_tensors=("blk.0.attn_qkv.weight",))
    with pytest.raises(sharpi.MissingTensorError, match="ssm_in"):
        sharpi.Session(broken, threads=1, n_ctx=64)


def test_failed_decode_leaves_a_state_that_must_be_reset(files, monkeypatch):
    """A decode that fails in layer 2's experts (an injected EIO) has already advanced the DeltaNet
    state of layers 0 and 2, which, unlike KV rows, cannot be ignored: the next decode is refused
    with a typed error naming reset(), and after reset() the session equals the resident one."""
    from sharpi import _core

    path = files["qwen35moe"]
    probe = sharpi.Session(path, threads=1, n_ctx=64, ram_budget="4GiB", reader="pread")
    st, info = probe.expert_stats(), probe.info
    budget = st["fixed_bytes"] + info["n_layer"] * info["n_expert"] * st["slot_bytes"]
    off, _ = _core.GgufFile(path).expert_range("blk.2.ffn_up_exps.weight", 5)
    monkeypatch.setenv("SHARPI_FAULT_EIO_AT", str(int(off) + 100))
    s = sharpi.Session(path, threads=2, n_ctx=64, ram_budget=budget, reader="pread")
    monkeypatch.delenv("SHARPI_FAULT_EIO_AT")
    resident = sharpi.Session(path, threads=2, n_ctx=64, dump_activations=True)
    # A token whose layer-2 routing picks expert 5, and one whose routing avoids it.
    hits, clean = None, None
    for t in range(2, 384):
        resident.reset()
        resident.decode([t])
        picked = 5 in resident.dump()["ffn_moe_topk-2"].astype(int).ravel()
        if picked and hits is None:
            hits = t
        if not picked and clean is None:
            clean = t
        if hits is not None and clean is not None:
            break
    assert hits is not None and clean is not None
    with pytest.raises(sharpi.IoError):
        s.decode([hits])
    with pytest.raises(sharpi.InvalidArgument, match="reset"):
        s.decode([clean])
    s.reset()
    resident.reset()
    np.testing.assert_array_equal(s.decode([clean]), resident.decode([clean]))
