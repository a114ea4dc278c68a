"""gpt-oss (GGUF arch "gpt-oss") on files written by llama.cpp's real converter from a tiny random
transformers GptOssForCausalLM (tests/reference/hf_export.py): attention sinks, q/k/v/o biases,
alternating sliding-window / full attention, YaRN, a biased router with softmax over the top-k,
expert biases and the clamped SwiGLU.

- f32 file, exact mode: logits within the budget below of HF (float64 on the same float32
  weights) at every position, prefill and token-by-token, and HF's 32 greedy tokens.
- Streamed == resident bit for bit at a 25% expert budget (fast and exact mode).
- MXFP4 experts: the f32 file's expert tensors quantized to MXFP4 by the gguf package; sharpi in
  exact mode on that file against HF running the gguf package's dequantization of the same blocks.

Skips (never fails) without torch/transformers or when the converter cannot be fetched.
"""

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5.0")

import sharpi
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from model_files import rewrite_gguf
from reference import hf_export
from reference.engine_checks import (
    check_greedy,
    check_prefill_and_stepwise,
    check_streams_like_resident,
    session_opener,
)

NAME = "gpt_oss"
# YaRN: a GGUF file carries no `truncate` flag, and llama.cpp (ggml_rope_yarn_corr_dims), like
# sharpi, rounds the correction range to whole dimensions (floor / ceil); gpt-oss's transformers
# config says truncate = False. So HF is run with truncate = True, the YaRN the file specifies, and
# the other archs' 1e-4 holds (measured: <= 1.6e-6 over the prompt). With truncate = False the
# measured gap is 4.8e-3 .. 9.5e-3 at positions 1-3 and grows past the first router flip
# (test_yarn_truncation_is_the_only_gap).
F32_BUDGET = 1e-4
N_PROMPT = 16
N_GREEDY = 32
THREADS = 2


@pytest.fixture(scope="module")
def converted(model_dir):
    try:
        converter = hf_export.converter_dir()
    except hf_export.ConverterUnavailable as error:
        pytest.skip(f"llama.cpp converter unavailable: {error}")
    return hf_export.prepare(NAME, model_dir, converter, outtypes=("f32",))


def _prompt(vocab_size, salt):
    return hf_export.random_prompt(vocab_size, N_PROMPT, 7000 + salt)


def _opener(path, **kwargs):
    def open_session(dump_activations):
        return sharpi.Session(
            str(path), threads=THREADS, n_ctx=0, exact=True, dump_activations=dump_activations, **kwargs
        )

    return open_session


def _hf_model(hf_dir, tmp_path_factory, truncate=True):
    """HF's model from hf_dir (float64), with YaRN's truncate set as asked (see F32_BUDGET)."""
    config = json.loads((hf_dir / "config.json").read_text())
    config["rope_parameters"]["truncate"] = truncate
    copy = tmp_path_factory.mktemp("gpt_oss_hf")
    shutil.copytree(hf_dir, copy, dirs_exist_ok=True)
    (copy / "config.json").write_text(json.dumps(config))
    return hf_export.load_hf_model_f64(copy)


def _check_against_hf(path, hf, prompt, budget, what):
    k = int(hf.config.num_experts_per_tok)

    def expected_for(tokens):
        return hf_export.hf_forward_result(hf, tokens, k)

    open_session = _opener(path)
    check_prefill_and_stepwise(open_session, prompt, expected_for(prompt), budget, what, k)
    check_greedy(open_session, prompt, expected_for, N_GREEDY, budget, what, k)


def test_file_carries_the_gpt_oss_parameters(converted):
    s = sharpi.Session(str(converted.gguf["f32"]), threads=1, n_ctx=64)
    info = s.info
    assert info["arch"] == "gpt-oss"
    assert info["n_expert"] == 8 and info["n_expert_used"] == 2


def test_sharpi_matches_transformers(converted, tmp_path_factory):
    hf = _hf_model(converted.exported.hf_dir, tmp_path_factory)
    prompt = _prompt(converted.exported.vocab_size, 1)
    _check_against_hf(converted.gguf["f32"], hf, prompt, F32_BUDGET, "gpt_oss (converter f32) vs HF")


def test_yarn_truncation_is_the_only_gap(converted, tmp_path_factory):
    # Against HF's own truncate = False the first positions (before any window or router flip)
    # differ by far more than 1e-4 but stay in the range YaRN's rounding explains: the comparison
    # above depends on the truncate setting, i.e. it really exercises YaRN.
    hf = _hf_model(converted.exported.hf_dir, tmp_path_factory, truncate=False)
    prompt = _prompt(converted.exported.vocab_size, 1)
    s = sharpi.Session(str(converted.gguf["f32"]), threads=THREADS, n_ctx=0, exact=True)
    ours = np.asarray(s.decode(prompt, True), np.float64).reshape(len(prompt), -1)
    ref = hf_export.hf_logits(hf, prompt)
    err = np.abs(ours - ref).max(axis=1) / np.abs(ref).max(axis=1)
    assert err[0] < F32_BUDGET  # position 0: no rotation
    assert np.all(err[1:4] > 1e-3) and np.all(err[1:4] < 2e-2), err[:4]


@pytest.mark.parametrize("exact", [False, True])
def test_streamed_equals_resident_at_a_quarter_budget(converted, exact):
    path = str(converted.gguf["f32"])

    open_session = session_opener(path, threads=2, n_ctx=128, exact=exact)

    prompt = _prompt(converted.exported.vocab_size, 2)
    check_streams_like_resident(open_session, prompt, 24, f"gpt-oss exact={exact}")


# ---- MXFP4 experts ------------------------------------------------------------------------------


def _mxfp4_roundtrip(raw_f32: np.ndarray, shape):
    """(MXFP4 bytes, f32 values they dequantize to) of an f32 tensor with ggml shape `shape`."""
    values = raw_f32.view(np.float32).reshape(list(reversed(shape)))
    blocks = gguf_quantize(values, Q.MXFP4)
    return blocks, gguf_dequantize(blocks, Q.MXFP4).astype(np.float32).reshape(values.shape)


@pytest.fixture(scope="module")
def mxfp4_model(converted, tmp_path_factory):
    """An MXFP4-expert GGUF and an HF checkpoint holding exactly its dequantized expert weights."""
    out = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    dequantized = {}

    def edit(name, raw, ttype, shape):
        if not name.endswith("_exps.weight"):
            return None
        assert ttype == Q.F32
        blocks, values = _mxfp4_roundtrip(raw, shape)
        dequantized[name] = values  # numpy [n_expert, rows, cols]
        return blocks.reshape(-1), Q.MXFP4, shape

    path = out / "gpt_oss-mxfp4.gguf"
    rewrite_gguf(str(converted.gguf["f32"]), str(path), tensor_edit=edit)
    assert len(dequantized) == 3 * 3  # three layers, gate / up / down

    hf = _hf_model(converted.exported.hf_dir, tmp_path_factory)
    with torch.no_grad():
        for il, layer in enumerate(hf.model.layers):
            gate = dequantized[f"blk.{il}.ffn_gate_exps.weight"]  # [E, n_ff, n_embd]
            up = dequantized[f"blk.{il}.ffn_up_exps.weight"]
            down = dequantized[f"blk.{il}.ffn_down_exps.weight"]  # [E, n_embd, n_ff]
            gate_up = layer.mlp.experts.gate_up_proj  # [E, n_embd, 2 n_ff], gate even / up odd columns
            gate_up[:, :, 0::2] = torch.from_numpy(gate.transpose(0, 2, 1).astype(np.float64))
            gate_up[:, :, 1::2] = torch.from_numpy(up.transpose(0, 2, 1).astype(np.float64))
            layer.mlp.experts.down_proj.copy_(torch.from_numpy(down.transpose(0, 2, 1).astype(np.float64)))
    return path, hf


def test_mxfp4_experts_exact_mode_match_dequantized_weights(mxfp4_model, converted):
    path, hf = mxfp4_model
    s = sharpi.Session(str(path), threads=1, n_ctx=64)
    assert s.info["arch"] == "gpt-oss"
    prompt = _prompt(converted.exported.vocab_size, 3)
    _check_against_hf(path, hf, prompt, F32_BUDGET, "gpt_oss (MXFP4 experts) vs HF on dequantized weights")


def test_hf_config_is_what_the_test_claims(converted):
    config = json.loads((converted.exported.hf_dir / "config.json").read_text())
    assert config["sliding_window"] == 8 and config["num_hidden_layers"] == 3
    assert config["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
