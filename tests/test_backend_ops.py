"""The one forward pass on a host (issue 38): every architecture's layers run through the backend
interface (cpp/src/backend/backend.h), recorded op by op on the CPU backend, and each recorded call is
judged by the CUDA backend's support table (backend/cuda_interface.h unsupported_op, host code in
every build). So without a GPU this shows which architectures the device can run and which op keeps
the others off it, by name, and that the table covers every op of the interface.

The expected blockers per architecture are written here from what the architectures compute (MLA for
deepseek2, the Gated DeltaNet for the hybrids, expert biases and the clamped SwiGLU for gpt-oss),
not taken from the table's answers.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import sharpi
from sharpi import _core, _internal, presets
from sharpi.make_model import write_model

ROOT = Path(__file__).resolve().parent.parent
BACKEND_H = ROOT / "cpp" / "src" / "backend" / "backend.h"
GGML_Q8_0, GGML_MXFP4, GGML_F16, GGML_F32 = 8, 39, 1, 0

# Ops no CUDA kernel runs yet, per architecture family (exact mode, q8_0 weights, f32 KV cache).
EXPECTED_BLOCKERS = {
    "llama": set(),
    "qwen2moe": set(),
    "qwen3moe": set(),
    "olmoe": set(),
    "qwen2": set(),
    "qwen3": set(),
    "deepseek2": {"mla_attention"},
    "qwen3next": {"gdn_gates", "conv1d_silu", "l2_norm_heads", "gated_delta_rule", "mul_sigmoid", "mul_silu"},
    "qwen35moe": {"gdn_gates", "conv1d_silu", "l2_norm_heads", "gated_delta_rule", "mul_sigmoid", "mul_silu"},
    # Sinks and the sliding window (ops/attention.cuh), the experts' biases and clamped SwiGLU
    # (ops/expert_ffn.cuh) are on the device.
    "gpt-oss": set(),
    # Sigmoid routing with a selection bias and a weight scale (ops/router.cu) is on the device.
    "glm4moe": set(),
    # Chunked attention, the router weight on the expert input and the attention temperature
    # (scale_rows) are on the device.
    "llama4": set(),
    "minimax-m2": set(),
    # The hyper-connections (their unweighted norm, weights, collapse and expansion) and the
    # sliding-window / compressed sparse attention over its f32 state rows.
    "deepseek4": {
        "rms_norm_unweighted", "hc_block_weights", "hc_head_weights", "hc_collapse", "hc_expand",
        "compressed_attention",
    },
    # MLA, plus DSA's indexer (its key LayerNorm and top-k).
    "deepseek32": {"mla_attention", "lightning_indexer", "layer_norm"},
    # Mamba-2 (conv with its state, the scan, the gated norm).
    "nemotron_h_moe": {"conv1d_silu", "ssm_scan", "mul_silu"},
}
# Blockers an architecture may add beyond EXPECTED_BLOCKERS depending on its tiny preset's router
# (DeepSeek-V3's group-limited routing is not on the device).
MAY_ALSO_BLOCK = {"deepseek2": {"route_topk"}, "deepseek32": {"route_topk"}}


def _interface_ops() -> set[str]:
    text = BACKEND_H.read_text()
    return set(re.findall(r"virtual\s+(?:void|Act|bool|const char\*)\s+(\w+)\(", text)) - {
        "name",
        "host_memory",
        "alloc",
        "reset_activations",
        "residual",
        "read",
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("backend_ops")
    out = {}
    for arch in presets.ARCHES:
        path = d / f"{arch}.gguf"
        write_model(path, arch=arch, preset="tiny", quant="q8_0", seed=5)
        out[arch] = path
    return out


@pytest.mark.parametrize("arch", presets.ARCHES)
def test_each_architecture_calls_only_interface_ops_and_the_cuda_table_names_every_blocker(models, arch):
    calls = _internal.record_forward_ops(str(models[arch]), [1, 7, 3, 9, 4], exact=True)
    ops = {op for op, _, _ in calls}
    assert ops <= _interface_ops(), ops - _interface_ops()
    # Both paths of the MoE FFN ran: the prefill batch grouped by expert, the decoded token fused.
    if presets.resolve(arch, "tiny").n_expert:
        assert {"route_topk", "expert_ffn_batch", "expert_ffn_one_token", "moe_combine"} <= ops
    blockers = {}
    for op, type_, variant in calls:
        why = _internal.cuda_unsupported_op(op, type_, variant)
        if why:
            assert why.startswith(op + " (") and ": " in why, why  # names the op and the type
            blockers.setdefault(op, why)
    expected = EXPECTED_BLOCKERS[arch]
    assert expected <= set(blockers), (expected - set(blockers), blockers)
    assert set(blockers) <= expected | MAY_ALSO_BLOCK.get(arch, set()), blockers


def test_gpt_oss_records_sinks_windows_and_expert_biases_the_device_takes(models):
    calls = _internal.record_forward_ops(str(models["gpt-oss"]), [2, 5, 8], exact=True)
    attention = [v for op, _, v in calls if op == "attention"]
    assert any("sinks" in v for v in attention) and any("window" in v for v in attention)
    assert all("sinks" in v for v in attention)  # every layer has sinks; even layers add a window
    assert all(_internal.cuda_unsupported_op("attention", GGML_F32, v) == "" for v in attention)
    experts = [(op, v) for op, _, v in calls if op.startswith("expert_ffn")]
    assert experts and all("bias" in v and "clamped_swiglu" in v for _, v in experts)
    assert all(_internal.cuda_unsupported_op(op, GGML_F32, v) == "" for op, v in experts)


def test_the_table_covers_every_op_of_the_interface():
    implemented = set(_internal.cuda_implemented_ops())
    for op in sorted(_interface_ops()):
        why = _internal.cuda_unsupported_op(op, GGML_F32, "")
        if op in implemented:
            assert why == "", (op, why)
        else:
            assert "no CUDA kernel yet" in why, (op, why)
    assert "no CUDA kernel yet" not in _internal.cuda_unsupported_op("matmul", GGML_F32, "")
    assert "not an op of the backend interface" in _internal.cuda_unsupported_op("conv2d", GGML_F32, "")


def test_the_table_refuses_types_and_variants_the_kernels_lack():
    assert _internal.cuda_unsupported_op("matmul", GGML_Q8_0, "exact") == ""
    why = _internal.cuda_unsupported_op("matmul", GGML_MXFP4, "")
    assert why.startswith("matmul (mxfp4)") or "MXFP4" in why.upper(), why
    assert "f32" in _internal.cuda_unsupported_op("attention", GGML_F16, "head_dim=64")
    assert _internal.cuda_unsupported_op("attention", GGML_F32, "head_dim=256") == ""
    assert "256" in _internal.cuda_unsupported_op("attention", GGML_F32, "head_dim=288")
    assert _internal.cuda_unsupported_op("rope", GGML_F32, "yarn,freq_factors") == ""
    assert _internal.cuda_unsupported_op("route_topk", GGML_F32, "n_expert=512") == ""
    assert "512" in _internal.cuda_unsupported_op("route_topk", GGML_F32, "n_expert=513")
    for variant in ("sigmoid,scale,selection_bias", "sqrt_softplus,scale", "sigmoid,rank_logits"):
        assert _internal.cuda_unsupported_op("route_topk", GGML_F32, variant + ",n_expert=8") == "", variant
    assert "groups" in _internal.cuda_unsupported_op("route_topk", GGML_F32, "sigmoid,groups,n_expert=8")


def test_recording_runs_the_forward_it_records(models):
    # The recorded pass is a real forward: its fast-mode calls carry the types the file has (q8_0
    # projections; the router stays f32, as llama.cpp's converter and quantizer keep it).
    calls = _internal.record_forward_ops(str(models["qwen3moe"]), [1, 2], exact=False)
    assert {t for op, t, _ in calls if op == "matmul"} == {GGML_Q8_0, GGML_F32}
    assert all(v == "" for op, _, v in calls if op == "matmul")  # fast mode
    assert {t for op, t, _ in calls if op == "kv_store"} == {GGML_F16}  # fast mode's f16 cache
    with pytest.raises(_core.InvalidArgument, match="out of the vocabulary"):
        _internal.record_forward_ops(str(models["qwen3moe"]), [10**6])


def test_the_forward_harness_on_the_cpu_backend_is_a_session_forward_and_batch_independent(models):
    # forward_logits drives the builders as the engine does (backend/op_trace.h run_forward), so its
    # rows are a Session's logits bit for bit, whatever the batching (docs/design.md §8).
    path = str(models["qwen3moe"])
    tokens = [1, 7, 3, 9, 4]
    prefill = _internal.forward_logits(path, tokens, backend="cpu", exact=True)
    assert prefill.shape == (len(tokens), presets.resolve("qwen3moe", "tiny").n_vocab)
    for batch in (1, 2):
        rows = _internal.forward_logits(path, tokens, backend="cpu", exact=True, batch=batch)
        assert rows.tobytes() == prefill.tobytes(), batch
    session = sharpi.Session(path, threads=1, exact=True, n_ctx=16)
    want = np.asarray(session.decode(tokens, all_logits=True), dtype=np.float32).reshape(prefill.shape)
    assert prefill.tobytes() == want.tobytes()


def test_the_forward_harness_names_its_errors(models):
    path = str(models["qwen3moe"])
    with pytest.raises(_core.InvalidArgument, match="unknown backend 'tpu'"):
        _internal.forward_logits(path, [1, 2], backend="tpu")
    with pytest.raises(_core.InvalidArgument, match="out of the vocabulary"):
        _internal.forward_logits(path, [10**6], backend="cpu")
    with pytest.raises(_core.InvalidArgument, match="q9_9"):
        _internal.forward_logits(path, [1, 2], backend="cpu", cache_type="q9_9")
    if not _internal.cuda_available():
        # No device (or a build without CUDA): a typed error before anything runs.
        # Without a device: require_device's "no (usable) CUDA device"; without CUDA: the stub's reason.
        with pytest.raises(
            (_core.DeviceError, _core.UnsupportedError), match=r"^\[cuda\].*(CUDA device|without)"
        ):
            _internal.forward_logits(path, [1, 2], backend="cuda")


@pytest.mark.parametrize("arch", presets.ARCHES)
def test_every_weight_the_builders_read_is_one_the_cuda_backend_uploads(models, arch):
    # The CUDA backend finds a weight by its host address among device_weights()' uploads (an
    # expert's bytes inside its stacked tensor included); one outside them would stop a device run
    # with "not uploaded" instead of the table's refusal naming the op.
    for exact in (True, False):
        assert _internal.cuda_weights_not_uploaded(str(models[arch]), [1, 7, 3, 9, 4], exact=exact) == []
