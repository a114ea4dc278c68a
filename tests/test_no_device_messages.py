"""What a machine without a GPU is told (issue 37): that there is no CUDA device, once, in plain words.

A CUDA build of sharpi on a machine with no NVIDIA driver used to print the CUDA runtime's
"CUDA driver version is insufficient for CUDA runtime version" and a libcufile install hint in
`sharpi inspect` and in the stats' reader_note. Neither helps there: the runtime's error reads like a
version mismatch, and cuFile cannot run without a device whatever library is installed. These tests run
the commands a newcomer runs (inspect, run with the stats written out) and read every line they print.
They need a machine without a device; with one, the device is real and they do not apply (the
reason is given in the skip).
"""

import ctypes
import json

import pytest
import sharpi
from sharpi import cli

pytestmark = pytest.mark.skipif(sharpi.cuda_available(), reason="a CUDA device is present: nothing to hide")

# Text that must never reach a user who simply has no GPU.
NOISE = ("insufficient", "cudaGetDeviceCount", "libcufile", "nvidia-cufile", "SHARPI_CUFILE_LIB")


def _driver_installed() -> bool:
    """Independent of sharpi: whether the NVIDIA driver library loads at all."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _assert_quiet(text: str) -> None:
    for noise in NOISE:
        assert noise not in text, f"{noise!r} in:\n{text}"


def test_describe_says_no_device_and_why():
    text = sharpi.cuda_describe()
    _assert_quiet(text)
    if text.startswith("CUDA unavailable: sharpi was built without"):
        return  # the stub build's own reason
    assert text.startswith("no CUDA device")
    assert ("(no NVIDIA driver)" in text) == (not _driver_installed())


def test_inspect_says_no_device_once(capsys):
    assert cli.main(["inspect"]) == 0  # the shipped model
    captured = capsys.readouterr()
    out = captured.out + captured.err
    _assert_quiet(out)
    device_lines = [ln for ln in out.splitlines() if sharpi.cuda_describe() in ln]
    assert device_lines == [f"device: {sharpi.cuda_describe()}: running on the CPU"]
    assert "cuFile reader (--reader cufile): unavailable: needs a CUDA device" in out.splitlines()


def test_streamed_run_and_its_stats_are_quiet(capsys, tmp_path):
    stats_path = tmp_path / "stats.json"
    # A RAM budget below the model's size streams the experts, so the reader and its note are used.
    argv = ["run", "-p", "def ", "-n", "4", "--ram-budget", "40MiB", "--expert-stats", str(stats_path)]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    _assert_quiet(captured.out + captured.err)
    assert "experts " in captured.err  # the cache summary line: the run did stream
    stats = json.loads(stats_path.read_text())
    _assert_quiet(json.dumps(stats))
    assert stats["reader_note"] == "cuFile unavailable: " + sharpi.cuda_describe()
