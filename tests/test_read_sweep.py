"""The SIMD read loop the decode benchmarks divide by (cpu/ops/read_sweep.h): every ISA's loop reads
every byte (its XOR of 64-bit words equals numpy's over fresh random data, a flipped bit anywhere
changes it), bad buffers and arguments get typed errors, and the measured bandwidth is a positive
rate for the threads asked. Oracle: numpy's bitwise_xor.reduce over the same words."""

import numpy as np
import pytest
from sharpi import _core, _internal


def _isas():
    return _internal.isa_available()


def _aligned(n_bytes, rng):
    raw = np.empty(n_bytes + 64, dtype=np.uint8)
    off = (-raw.ctypes.data) % 64
    buf = raw[off:off + n_bytes]
    buf[:] = rng.integers(0, 256, n_bytes, dtype=np.uint8)
    return buf


@pytest.mark.parametrize("n_bytes", [256, 4096, 256 * 1001])
def test_every_isa_reads_every_word(n_bytes):
    rng = np.random.default_rng()
    buf = _aligned(n_bytes, rng)
    want = int(np.bitwise_xor.reduce(buf.view(np.uint64)))
    for isa in _isas():
        assert _internal.read_sweep(buf, isa) == want, isa
        pos = int(rng.integers(0, n_bytes))
        buf[pos] ^= 1 << int(rng.integers(0, 8))
        flipped = int(np.bitwise_xor.reduce(buf.view(np.uint64)))
        assert flipped != want and _internal.read_sweep(buf, isa) == flipped, isa
        want = flipped


def test_bad_buffers_and_arguments_are_refused():
    buf = _aligned(512, np.random.default_rng())
    with pytest.raises(_core.InvalidArgument, match="multiple of 256"):
        _internal.read_sweep(buf[:300])
    with pytest.raises(_core.InvalidArgument, match="aligned"):
        _internal.read_sweep(buf[8:264])  # buf is 64-byte aligned, so buf + 8 is not
    with pytest.raises(_core.InvalidArgument, match="unknown isa"):
        _internal.read_sweep(buf, "sse9")
    with pytest.raises(_core.InvalidArgument, match="repeats"):
        _internal.read_bandwidth(1, 1 << 20, 0)


@pytest.mark.parametrize("threads", [1, 2])
def test_bandwidth_is_a_rate_for_the_threads_asked(threads):
    r = _internal.read_bandwidth(threads, 16 << 20, 3)
    assert r["threads"] == threads and r["buffer_bytes"] == 16 << 20
    assert r["isa"] == _internal.active_isa()
    # Bytes per second of a real sweep: above 100 MB/s on any machine that runs the suite, and
    # the best of the repeats is at least their median.
    assert r["gbps"] >= r["median_gbps"] > 0.1
