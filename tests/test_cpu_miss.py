"""CPU compute of VRAM misses, the host half (moe/cpu_miss.h): the route of each selected expert under each
mode on given bandwidths, the CPU side of the cost model's inputs (the CPU expert kernel timed on the
model's own bytes), and the session options' typed errors before any device is touched.

Oracles: the cost model as issue 22 states it, restated here in float64 (copy: latency + bytes / copy_bw;
cpu: 2 latency + 2 rows row_bytes / copy_bw + rows bytes / cpu_bw), and the rule that an expert already in
VRAM (or loading) is never sent to the CPU. The device half (timed copies, the CPU rows sent up, logits
within the GPU-vs-CPU budget) is tests/test_cuda_stream_gpu.py's.
"""

import math

import numpy as np
import pytest
import sharpi
from sharpi import DeviceError, InvalidArgument, UnsupportedError, _internal
from test_session import models  # noqa: F401  (fixture: tiny files of every plain MoE arch)

EXPERT = 2_654_208  # a Qwen3-30B-A3B Q4_K_M expert
N_EMBD = 2048
LATENCY = 10e-6


def model_route(copy_bw, cpu_bw, rows=1):
    copy_s = LATENCY + EXPERT / copy_bw
    cpu_s = 2 * LATENCY + 2 * rows * N_EMBD * 4 / copy_bw + rows * EXPERT / cpu_bw
    return "cpu" if cpu_s < copy_s else "copy"


@pytest.mark.parametrize("copy_bw, cpu_bw", [(25e9, 20e9), (6e9, 20e9), (3e9, 40e9), (12e9, 12e9)])
def test_routes_by_mode_on_given_bandwidths(copy_bw, cpu_bw):
    rng = np.random.default_rng(3)
    for _ in range(20):
        present = [bool(b) for b in rng.integers(0, 2, size=8)]
        args = (EXPERT, N_EMBD, 1, copy_bw, LATENCY, cpu_bw)
        assert _internal.miss_routes("copy", present, *args) == ["copy"] * 8
        assert _internal.miss_routes("cpu", present, *args) == ["copy" if p else "cpu" for p in present]
        want = model_route(copy_bw, cpu_bw)
        assert _internal.miss_routes("auto", present, *args) == ["copy" if p else want for p in present]


def test_route_mode_and_inputs_are_checked():
    with pytest.raises(InvalidArgument, match="miss route"):
        _internal.miss_routes("gpu", [False], EXPERT, N_EMBD, 1, 1e9, LATENCY, 1e9)
    with pytest.raises(InvalidArgument, match=r"\[miss cost\]"):  # auto with a miss: the model's own check
        _internal.miss_routes("auto", [False], EXPERT, N_EMBD, 1, 0.0, LATENCY, 1e9)
    # Nothing missing: the model is never consulted, so unmeasured inputs are no error.
    assert _internal.miss_routes("auto", [True, True], EXPERT, N_EMBD, 1, 0.0, LATENCY, 0.0) == ["copy", "copy"]


@pytest.mark.parametrize("quant", ["f32", "q4_k_m"])
def test_cpu_expert_speed_is_a_plausible_measurement(models, quant):  # noqa: F811
    # The CPU kernel streams the expert's weight bytes once per row: between 1 MB/s (a stalled shared
    # core) and 1 TB/s (beyond any DRAM or cache here). Exact mode dequantizes and is not faster by
    # orders of magnitude than fast mode on the same bytes.
    path = models["qwen3moe", quant]
    fast = _internal.cpu_expert_speed(path, threads=1, exact=False, repeats=5)
    exact = _internal.cpu_expert_speed(path, threads=1, exact=True, repeats=5)
    for v in (fast, exact):
        assert math.isfinite(v) and 1e6 < v < 1e12, (fast, exact)
    assert exact < 100 * fast and fast < 100 * exact, (fast, exact)


def test_cpu_expert_speed_refuses_bad_input(models, tmp_path):  # noqa: F811
    with pytest.raises(InvalidArgument, match="repeats"):
        _internal.cpu_expert_speed(models["olmoe", "q4_k_m"], repeats=0)
    from sharpi.make_model import write_model

    dense = str(tmp_path / "dense.gguf")
    write_model(dense, arch="qwen3", preset="tiny", quant="q8_0", seed=3)
    with pytest.raises(InvalidArgument, match="no routed experts"):
        _internal.cpu_expert_speed(dense)


@pytest.mark.skipif(sharpi.cuda_available(), reason="a CUDA device is present: tests/test_cuda_stream_gpu.py "
                    "runs miss_route on it")
def test_session_miss_route_options_are_checked_before_the_device(models, monkeypatch):  # noqa: F811
    monkeypatch.delenv("SHARPI_CPU_MOE", raising=False)
    path = models["qwen3moe", "q4_k_m"]
    low = _internal.tier_plan_file(path, 1 << 40, 0, n_ctx=256)["vram_minimum_bytes"]
    with pytest.raises(InvalidArgument, match="miss route"):
        sharpi.Session(path, device="cuda", n_ctx=256, vram_budget=low, miss_route="gpu")
    with pytest.raises(InvalidArgument, match="device=\"cuda\""):
        sharpi.Session(path, n_ctx=256, miss_route="cpu")
    with pytest.raises(InvalidArgument, match="needs a vram_budget"):
        sharpi.Session(path, device="cuda", n_ctx=256, vram_budget="1TiB", miss_route="auto")
    with pytest.raises(InvalidArgument, match="miss_bandwidths"):
        sharpi.Session(path, device="cuda", n_ctx=256, vram_budget=low, miss_route="auto",
                       miss_bandwidths={"pcie": 1e9})
    # Valid options get as far as the device.
    for route in ("copy", "cpu", "auto"):
        with pytest.raises((DeviceError, UnsupportedError)):
            sharpi.Session(path, device="cuda", n_ctx=256, vram_budget=low, miss_route=route,
                           miss_bandwidths={"copy_bytes_per_s": 1e9})
