"""Session(vram_budget=...) and `sharpi run --vram-budget` without a device: the tier planner's decision and
the typed errors, all before anything is allocated on a device.

The planner itself is checked against hand arithmetic in test_tier_plan.py; here its minimum (read from
_internal.tier_plan_file, the `sharpi inspect --plan` entry) is the boundary the session must enforce: one byte
below it is an InvalidArgument naming the minimum, at it the session goes on to open the device, which
without one is a DeviceError (a CUDA build) or UnsupportedError (a build without CUDA). `auto` needs a
device's free VRAM: DeviceError. The device-side behaviour (streamed logits equal resident ones) is
tests/test_cuda_stream_gpu.py's.
"""


import pytest
import sharpi
from sharpi import DeviceError, InvalidArgument, UnsupportedError, _internal
from test_cli import sharpi_cli
from test_session import models  # noqa: F401  (fixture: tiny files of every plain MoE arch)

pytestmark = pytest.mark.skipif(sharpi.cuda_available(), reason="a CUDA device is present: "
                                "tests/test_cuda_stream_gpu.py runs vram_budget on it")

N_CTX = 256


def minimum(path, lookahead=0):
    return _internal.tier_plan_file(path, 1 << 40, 0, n_ctx=N_CTX, lookahead=lookahead)["vram_minimum_bytes"]


def no_device_error(excinfo):
    """The error a session that got past the planner raises here: the device path's own refusal."""
    if isinstance(excinfo.value, UnsupportedError):
        assert "built without the CUDA backend" in str(excinfo.value)
    else:
        assert isinstance(excinfo.value, DeviceError) and "CUDA device" in str(excinfo.value)


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "olmoe", "llama"])
def test_below_the_minimum_is_an_invalid_argument_naming_it(models, arch):  # noqa: F811
    path = models[arch, "q4_k_m"]
    low = minimum(path)
    with pytest.raises(InvalidArgument, match="vram_budget") as excinfo:
        sharpi.Session(path, device="cuda", n_ctx=N_CTX, vram_budget=low - 1)
    assert str(low) in str(excinfo.value) or f"{low / 2**20:.1f}" in str(excinfo.value), str(excinfo.value)
    # At the minimum the plan holds; the session then needs the device.
    with pytest.raises((DeviceError, UnsupportedError)) as excinfo:
        sharpi.Session(path, device="cuda", n_ctx=N_CTX, vram_budget=low)
    no_device_error(excinfo)


def test_a_predictor_raises_the_minimum_by_its_staging_slots(models):  # noqa: F811
    path = models["qwen3moe", "q4_k_m"]
    low, with_staging = minimum(path), minimum(path, lookahead=2)
    assert with_staging > low
    with pytest.raises(InvalidArgument, match="vram_budget"):
        sharpi.Session(path, device="cuda", n_ctx=N_CTX, vram_budget=with_staging - 1, predictor="prev_token",
                       lookahead=2)
    with pytest.raises((DeviceError, UnsupportedError)) as excinfo:
        sharpi.Session(path, device="cuda", n_ctx=N_CTX, vram_budget=with_staging, predictor="prev_token",
                       lookahead=2)
    no_device_error(excinfo)


def test_a_predictor_with_every_expert_fitting_is_refused(models):  # noqa: F811
    # Nothing streams when the budget holds every expert: a predictor would have nothing to prefetch.
    path = models["qwen3moe", "q4_k_m"]
    plan = _internal.tier_plan_file(path, 1 << 40, 0, n_ctx=N_CTX, lookahead=1)
    assert plan["experts_resident"]
    with pytest.raises(InvalidArgument, match="nothing to prefetch"):
        sharpi.Session(path, device="cuda", n_ctx=N_CTX, vram_budget="1TiB", predictor="prev_token")


def test_sizes_with_units_and_auto(models):  # noqa: F811
    path = models["olmoe", "q4_k_m"]
    with pytest.raises(InvalidArgument, match="vram_budget"):
        sharpi.Session(path, device="cuda", n_ctx=N_CTX, vram_budget="1KiB")
    with pytest.raises((DeviceError, UnsupportedError)) as excinfo:
        sharpi.Session(path, device="cuda", n_ctx=N_CTX, vram_budget="1TiB")
    no_device_error(excinfo)
    # auto reads the device's free VRAM: without a device that is a DeviceError in every build.
    with pytest.raises(DeviceError, match="auto"):
        sharpi.Session(path, device="cuda", n_ctx=N_CTX, vram_budget="auto")
    for bad in ("12 parsecs", -1, 1.5):
        with pytest.raises(InvalidArgument):
            sharpi.Session(path, device="cuda", n_ctx=N_CTX, vram_budget=bad)


def test_vram_budget_needs_device_cuda_and_an_moe_model(models, tmp_path):  # noqa: F811
    with pytest.raises(InvalidArgument, match="device=\"cuda\""):
        sharpi.Session(models["qwen3moe", "q4_k_m"], vram_budget="1GiB")
    from sharpi.make_model import write_model

    dense = str(tmp_path / "dense.gguf")
    write_model(dense, arch="qwen3", preset="tiny", quant="q8_0", seed=3)
    with pytest.raises(InvalidArgument, match="dense model"):
        sharpi.Session(dense, device="cuda", n_ctx=N_CTX, vram_budget="1GiB")


def test_run_vram_budget_errors_are_typed_cli_errors(models):  # noqa: F811
    path = models["qwen3moe", "q4_k_m"]
    r = sharpi_cli("run", "-m", path, "-p", "hi", "-n", "1", "-c", str(N_CTX), "--device", "cuda",
                   "--vram-budget", "1KiB")
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "vram_budget" in r.stderr and "minimum" in r.stderr, r.stderr
    r = sharpi_cli("run", "-m", path, "-p", "hi", "-n", "1", "-c", str(N_CTX), "--device", "cuda",
                   "--vram-budget", "auto")
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "auto" in r.stderr and "CUDA" in r.stderr, r.stderr
