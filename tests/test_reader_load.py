"""The readers' own load accounting (ExpertReader::inflight_bytes / busy_ms / bytes_per_ms), which the
prefetcher's timeliness test and the io_busy_ms metric read: requested bytes count from submit until
reap or cancel, busy time grows only while something is outstanding, and the bandwidth is the
completed bytes over it.
"""

from __future__ import annotations

import time

import pytest
from sharpi import _core, _internal
from sharpi import make_model as mm


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("reader_load") / "tiny.gguf"
    mm.write_model(path, preset="tiny", quant="q8_0")
    return path


def open_reader(kind, path, **kwargs):
    if kind == "uring" and not _internal.uring_compiled():
        pytest.skip("io_uring reader not compiled (liburing missing at build time)")
    try:
        return _internal.ExpertReaderTest(kind, str(path), **kwargs)
    except _core.UnsupportedError as e:
        pytest.skip(f"io_uring unavailable here: {e}")


@pytest.mark.parametrize("kind", ["pread", "uring"])
def test_inflight_bytes_busy_time_and_bandwidth(kind, tiny_gguf):
    r = open_reader(kind, tiny_gguf, queue_depth=1, pread_threads=1)
    assert r.inflight_bytes == 0 and r.busy_ms == 0.0 and r.bytes_per_ms == 0.0
    r.plug()  # nothing starts: the cancel below is certain to find its request unstarted
    r.submit(1, 100, 5000, "demand")
    r.submit(2, 20000, 3000, "prefetch")
    r.submit(3, 40000, 777, "prefetch")
    assert r.inflight_bytes == 5000 + 3000 + 777
    assert r.cancel(3)
    assert r.inflight_bytes == 5000 + 3000
    time.sleep(0.01)
    assert r.busy_ms >= 10.0  # busy since the first submit, outstanding or not started
    r.unplug()
    done = []
    while r.outstanding:
        done += r.reap(wait=True)
    assert sorted(tag for tag, ok, _ in done) == [1, 2] and all(ok for _, ok, _ in done)
    assert r.inflight_bytes == 0
    busy = r.busy_ms
    time.sleep(0.01)
    assert r.busy_ms == busy  # idle time is not busy time
    assert r.bytes_per_ms == pytest.approx((5000 + 3000) / busy)
