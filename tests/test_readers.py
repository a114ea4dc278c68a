"""The expert readers (cpp/src/io/) against Python's own file reads, and against each other.

Oracles: bytes read by Python (open/seek/read) for the same ranges, and the gguf package's view of
each expert's slice of a real GGUF written by sharpi.make_model. Ordering, cancel and promote are
checked on a reader with one read in flight (queue_depth=1 / pread_threads=1) and a plugged queue,
so that the completion order is fully determined by the priority rules. Every case runs with both
readers: on Linux an io_uring reader that cannot be built or opened fails the test (reader_policy.py).
"""

from __future__ import annotations

import errno
import gc
import os
import random
import re
import subprocess
import sys
import textwrap
import time

import gguf
import numpy as np
import pytest
from reader_policy import URING_REQUIRED, uring_unavailable
from sharpi import _core, _internal
from sharpi import make_model as mm

KINDS = ["pread", "uring"]
ALIGN = 4096


def open_reader(kind, path, **kwargs):
    """A reader of `kind`; fails the test (on Linux) when io_uring cannot be used here."""
    if kind == "uring" and not _internal.uring_compiled():
        uring_unavailable("not compiled into this build")
    try:
        return _internal.ExpertReaderTest(kind, str(path), **kwargs)
    except _core.UnsupportedError as e:
        uring_unavailable(str(e))


def python_read(path, offset, length):
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


@pytest.fixture(scope="module")
def random_file(tmp_path_factory):
    """~6 MB of random bytes; the size is deliberately not a multiple of 4096."""
    path = tmp_path_factory.mktemp("readers") / "random.bin"
    size = 6 * 1024 * 1024 + 1234
    path.write_bytes(np.random.default_rng(1234).integers(0, 256, size, dtype=np.uint8).tobytes())
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("readers") / "tiny-q4_k_m.gguf"
    mm.write_model(path, preset="tiny", quant="q4_k_m")
    return path


def random_ranges(size, n, seed):
    """Random ranges of every awkward kind: unaligned, tiny, chunk-crossing, ending at end of file."""
    rng = random.Random(seed)
    ranges = []
    for i in range(n):
        kind = i % 6
        if kind == 0:  # anything, up to 2 MiB
            offset = rng.randrange(size)
            length = rng.randint(1, min(2 << 20, size - offset))
        elif kind == 1:  # tiny
            offset = rng.randrange(size)
            length = rng.randint(1, min(17, size - offset))
        elif kind == 2:  # ends exactly at end of file
            length = rng.randint(1, min(1 << 20, size))
            offset = size - length
        elif kind == 3:  # aligned start and length
            offset = rng.randrange(size // ALIGN) * ALIGN
            length = min(ALIGN * rng.randint(1, 64), size - offset)
        elif kind == 4:  # straddles a 4 KiB boundary by a few bytes
            boundary = ALIGN * rng.randint(1, size // ALIGN - 1)
            offset = boundary - rng.randint(1, 8)
            length = rng.randint(2, 16)
        else:  # expert-sized
            length = rng.randint(200_000, 1_700_000)
            offset = rng.randrange(size - length)
        ranges.append((offset, length, "demand" if rng.random() < 0.5 else "prefetch"))
    ranges.append((0, size, "demand"))  # the whole file
    ranges.append((size - 1, 1, "prefetch"))  # the last byte
    return ranges


@pytest.mark.concurrency
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("depth,chunk,register", [(0, 0, True), (3, 8192, True), (0, 0, False)])
def test_random_ranges_equal_python_read(kind, depth, chunk, register, random_file):
    data = random_file.read_bytes()
    reader = open_reader(
        kind,
        random_file,
        arena_bytes=32 << 20,
        queue_depth=depth,
        pread_threads=depth,
        chunk_bytes=chunk,
        register_arena=register,
    )
    if kind == "uring":
        assert ("registered buffers" if register else "plain buffers (no arena given)") in reader.describe
    ranges = random_ranges(len(data), 240, seed=depth * 7 + chunk)
    got = reader.read(ranges)
    assert len(got) == len(ranges)
    for (offset, length, _), blob in zip(ranges, got):
        assert blob == data[offset : offset + length], f"{reader.describe}: range [{offset}, +{length})"
    assert reader.outstanding == 0


def test_uring_and_pread_place_identical_bytes(random_file):
    """The whole aligned superset (inside the file) is the same in both readers and equals the file."""
    data = random_file.read_bytes()
    size = len(data)
    ranges = random_ranges(size, 120, seed=99)
    uring = open_reader("uring", random_file, arena_bytes=32 << 20)
    pread = open_reader("pread", random_file, arena_bytes=32 << 20)
    spans_u = uring.read(ranges, whole_span=True)
    spans_p = pread.read(ranges, whole_span=True)
    for (offset, length, _), su, sp in zip(ranges, spans_u, spans_p):
        begin = offset // ALIGN * ALIGN
        end = min(-(-(offset + length) // ALIGN) * ALIGN, size)
        assert len(su) == len(sp) == -(-(offset + length) // ALIGN) * ALIGN - begin
        inside = end - begin  # bytes past the end of the file are unspecified
        assert su[:inside] == sp[:inside] == data[begin:end]
        assert su[offset - begin : offset - begin + length] == data[offset : offset + length]


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_expert_ranges(kind, tiny_gguf):
    """Every expert slice of every expert tensor of a real q4_k_m GGUF, checked two independent ways."""
    f = _core.GgufFile(str(tiny_gguf))
    reference = {t.name: t for t in gguf.GGUFReader(str(tiny_gguf)).tensors}
    requests, expected = [], []
    for t in f.tensors():
        if "_exps" not in t["name"]:
            continue
        n_expert = t["shape"][-1]
        per_expert = reference[t["name"]].data.reshape(n_expert, -1)
        for e in range(n_expert):
            offset, nbytes = f.expert_range(t["name"], e)
            requests.append((offset, nbytes, "prefetch" if e % 3 else "demand"))
            expected.append(per_expert[e].tobytes())
            assert expected[-1] == python_read(tiny_gguf, offset, nbytes)
    assert len(requests) >= 24
    assert any(offset % ALIGN for offset, _, _ in requests), "want unaligned expert ranges"
    reader = open_reader(kind, tiny_gguf, arena_bytes=8 << 20)
    assert reader.read(requests) == expected
    # The last tensor's last expert usually ends near the end of the file: also read up to the end.
    size = os.path.getsize(tiny_gguf)
    last = max(requests, key=lambda r: r[0] + r[1])
    tail = (last[0], size - last[0], "demand")
    assert reader.read([tail]) == [python_read(tiny_gguf, last[0], size - last[0])]


@pytest.mark.parametrize("kind", KINDS)
def test_file_smaller_than_one_block(kind, tmp_path):
    path = tmp_path / "small.bin"
    data = bytes(np.random.default_rng(5).integers(0, 256, 100, dtype=np.uint8))
    path.write_bytes(data)
    reader = open_reader(kind, path)
    ranges = [(0, 100, "demand"), (99, 1, "prefetch"), (0, 1, "demand"), (37, 50, "demand")]
    assert reader.read(ranges) == [data[o : o + n] for o, n, _ in ranges]


@pytest.mark.parametrize("kind", KINDS)
def test_range_past_end_of_file_is_an_error(kind, random_file):
    size = os.path.getsize(random_file)
    reader = open_reader(kind, random_file, chunk_bytes=8192)
    for offset, length in [(size - 10, 11), (size, 1), (size + 10_000, 5), (size - 300_000, 300_001)]:
        with pytest.raises(_core.IoError) as info:
            reader.read([(offset, length, "demand")])
        message = str(info.value)
        assert message.startswith(f"[io] {random_file}: read of [{offset:#x}, {offset + length:#x}) failed: ")
        assert "end of file" in message
        assert reader.outstanding == 0
    # Still usable, and a good read next to a bad one completes with the right bytes.
    good = (size - 10, 10, "prefetch")
    assert reader.read([good]) == [python_read(random_file, size - 10, 10)]
    with pytest.raises(_core.IoError, match=f"read of \\[{size - 5:#x}, {size + 1:#x}\\)"):
        reader.read([good, (size - 5, 6, "demand"), good[:1] + (3, "demand")])


def completion_order(reader):
    order = []
    while reader.outstanding:
        for tag, ok, error in reader.reap(True):
            assert ok, error
            order.append(tag)
    return order


@pytest.mark.parametrize("kind", KINDS)
def test_demand_before_prefetch(kind, random_file):
    """Queue deeper than the in-flight depth: every demand starts before any queued prefetch."""
    data = random_file.read_bytes()
    reader = open_reader(kind, random_file, queue_depth=1, pread_threads=1)
    rng = random.Random(3)
    reader.plug()
    requests = {}
    for tag in range(12):
        priority = "demand" if tag % 4 == 3 else "prefetch"
        offset = rng.randrange(len(data) - 70_000)
        requests[tag] = (offset, rng.randint(1, 70_000))
        reader.submit(tag, *requests[tag], priority)
    reader.unplug()
    order = completion_order(reader)
    demands = [t for t in range(12) if t % 4 == 3]
    prefetches = [t for t in range(12) if t % 4 != 3]
    assert order == demands + prefetches
    for tag, (offset, length) in requests.items():
        assert reader.data(tag) == data[offset : offset + length]


@pytest.mark.parametrize("kind", KINDS)
def test_demand_overtakes_a_started_prefetch(kind, tmp_path, monkeypatch):
    """A long prefetch is read in 4 KiB chunks, so a demand submitted after it has started finishes
    before it. A tiny prefetch goes first: when reap() returns it, the I/O thread has already taken
    the long prefetch's first chunk (it does so before announcing completions), and cancel()
    returning False confirms the long one is in flight.

    The demand must be submitted while the long prefetch is still being read. From the page cache
    a pread reader finishes 48 MiB of chunks in a few milliseconds, which a descheduled test thread
    on a busy machine can miss (CI once saw [9, 0, 1] five times), so the pread reader's test hook
    delays each prefetch chunk by 20 ms: 64 chunks keep the prefetch in flight for 1.3 s, and the
    order no longer depends on scheduling. io_uring reads 48 MiB with O_DIRECT from the device,
    4 KiB at a time at depth 1: over a second on this machine's disks. A reader that reads requests
    whole loses every attempt either way."""
    if kind == "pread":
        monkeypatch.setenv("SHARPI_FAULT_PREFETCH_DELAY_US", "20000")  # read at reader construction
        size = 64 * 4096
    else:
        size = 48 << 20
    path = tmp_path / "long.bin"
    path.write_bytes(np.random.default_rng(11).integers(0, 256, size + 5000, dtype=np.uint8).tobytes())
    orders = []
    for _attempt in range(3):
        reader = open_reader(
            kind, path, arena_bytes=size + (1 << 20), queue_depth=1, pread_threads=1, chunk_bytes=4096
        )
        reader.submit(9, 77, 10, "prefetch")
        reader.submit(0, 0, size, "prefetch")
        reader.submit(1, size + 10, 1000, "prefetch")
        first = [tag for tag, _, _ in reader.reap(True)]
        if reader.cancel(0):
            # Not started yet: the worker finished 9 before 0 was submitted (the test thread was
            # descheduled between the submits) and has not woken for it. A scheduling outcome, not
            # the reader's order: try again.
            orders.append(["0 cancelled before it started", *first, *completion_order(reader)])
            continue
        if first != [9]:
            orders.append(first + completion_order(reader))
            continue
        reader.submit(2, 123_457, 10_000, "demand")
        orders.append(completion_order(reader))
        assert reader.data(2) == python_read(path, 123_457, 10_000)
        if orders[-1] == [2, 0, 1]:
            assert reader.data(0) == python_read(path, 0, size)
            return
    pytest.fail(f"the demand never overtook the started prefetch: completion orders {orders}")


@pytest.mark.concurrency
@pytest.mark.parametrize("kind", KINDS)
def test_cancel_and_promote(kind, random_file):
    data = random_file.read_bytes()
    reader = open_reader(kind, random_file, queue_depth=1, pread_threads=1)
    reader.plug()
    for tag in range(5):
        reader.submit(tag, 10_000 * tag + 17, 5_000 + tag, "prefetch")
    assert reader.cancel(2) is True
    assert reader.cancel(2) is False  # already gone
    assert reader.cancel(777) is False  # never submitted
    reader.promote(4)  # to the back of the (empty) demand list
    reader.submit(5, 1_000_000, 3, "demand")
    reader.promote(5)  # already demand: no-op
    reader.promote(777)  # unknown: no-op
    assert reader.outstanding == 5
    reader.unplug()
    order = completion_order(reader)
    assert order == [4, 5, 0, 1, 3]
    assert reader.cancel(0) is False  # completed
    for tag in order:
        offset, length = (1_000_000, 3) if tag == 5 else (10_000 * tag + 17, 5_000 + tag)
        assert reader.data(tag) == data[offset : offset + length]


@pytest.mark.parametrize("kind", KINDS)
def test_cancel_answer_matches_outcome(kind, random_file):
    """cancel() of a read that may be in flight: False means it completes with the right bytes, True
    means it never completes. With 1536 chunks at depth 1 the read has started well before the
    sleep ends, so this normally exercises the in-flight case."""
    reader = open_reader(kind, random_file, queue_depth=1, pread_threads=1, chunk_bytes=4096)
    reader.submit(0, 0, 6 << 20, "demand")
    reader.submit(1, 100, 100, "prefetch")
    time.sleep(0.05)
    cancelled = reader.cancel(0)
    order = completion_order(reader)
    if cancelled:
        assert order == [1]
    else:
        assert order == [0, 1]
        assert reader.data(0) == python_read(random_file, 0, 6 << 20)
    assert reader.data(1) == python_read(random_file, 100, 100)


@pytest.mark.parametrize("kind", KINDS)
def test_injected_eio(kind, tiny_gguf, monkeypatch):
    """SHARPI_FAULT_EIO_AT is read at construction and fails exactly the reads covering it."""
    f = _core.GgufFile(str(tiny_gguf))
    name = next(t["name"] for t in f.tensors() if "ffn_down_exps" in t["name"])
    offset, nbytes = f.expert_range(name, 1)
    fault = offset + nbytes // 3
    monkeypatch.setenv("SHARPI_FAULT_EIO_AT", str(fault))
    reader = open_reader(kind, tiny_gguf, chunk_bytes=8192)
    monkeypatch.delenv("SHARPI_FAULT_EIO_AT")  # the reader keeps what it read at construction
    assert f"{fault:#x}" in reader.describe
    with pytest.raises(_core.IoError) as info:
        reader.read([(offset, nbytes, "demand")])
    message = str(info.value)
    assert message == (
        f"[io] {tiny_gguf}: read of [{offset:#x}, {offset + nbytes:#x}) failed: {os.strerror(5)}"
    )
    # Neighbours (even those sharing the fault's 4 KiB block) and a batch around the bad read.
    before = (offset - 100, 100, "prefetch")
    after = (fault + 1, 50, "demand")
    assert reader.read([before, after]) == [python_read(tiny_gguf, o, n) for o, n, _ in (before, after)]
    with pytest.raises(_core.IoError, match=f"read of \\[{fault:#x}, {fault + 1:#x}\\)"):
        reader.read([before, (fault, 1, "prefetch"), after])
    assert reader.outstanding == 0
    # A reader built after the variable is gone reads the range.
    clean = open_reader(kind, tiny_gguf)
    assert clean.read([(offset, nbytes, "demand")]) == [python_read(tiny_gguf, offset, nbytes)]


def test_injected_eio_hex_and_bad_value(tiny_gguf, monkeypatch):
    monkeypatch.setenv("SHARPI_FAULT_EIO_AT", "0x1000")
    reader = _internal.ExpertReaderTest("auto", str(tiny_gguf))
    with pytest.raises(_core.IoError, match="read of \\[0xff0, 0x1010\\)"):
        reader.read([(0xFF0, 0x20, "demand")])
    monkeypatch.setenv("SHARPI_FAULT_EIO_AT", "12abc")
    for kind in ["pread", "auto"]:
        with pytest.raises(_core.InvalidArgument, match="SHARPI_FAULT_EIO_AT: not a byte offset: '12abc'"):
            _internal.ExpertReaderTest(kind, str(tiny_gguf))


def test_injected_eio_from_a_fresh_process(tiny_gguf):
    """The variable set in the environment of a new process (as a user would) takes effect."""
    script = textwrap.dedent(
        f"""
        from sharpi import _core, _internal
        r = _internal.ExpertReaderTest("auto", {str(tiny_gguf)!r})
        try:
            r.read([(4000, 200, "demand")])
        except _core.IoError as e:
            print(e)
        """
    )
    env = dict(os.environ, SHARPI_FAULT_EIO_AT="4100")
    out = subprocess.run(
        [sys.executable, "-c", script], check=False, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"[io] {tiny_gguf}: read of [0xfa0, 0x1068) failed: {os.strerror(5)}"


def o_direct_works(path):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    try:
        import mmap

        block = mmap.mmap(-1, ALIGN)  # page-aligned
        os.preadv(fd, [block], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def test_tmpfs_auto_falls_back_when_o_direct_is_refused(tmp_path):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    data = bytes(np.random.default_rng(8).integers(0, 256, 300_001, dtype=np.uint8))
    path = f"/dev/shm/sharpi-readers-{os.getpid()}.bin"
    with open(path, "wb") as f:
        f.write(data)
    try:
        ranges = [(1, 70_000, "demand"), (300_000, 1, "prefetch"), (4096, 8192, "demand")]
        expected = [data[o : o + n] for o, n, _ in ranges]
        auto = _internal.ExpertReaderTest("auto", path)
        assert auto.read(ranges) == expected
        if o_direct_works(path) and _internal.uring_compiled():
            # Newer kernels (6.6+) give tmpfs O_DIRECT; then auto may well use io_uring.
            assert auto.name in ("io_uring", "pread")
        else:
            assert auto.name == "pread", auto.describe
            assert "io_uring unavailable" in auto.describe
            with pytest.raises(_core.UnsupportedError, match=f"\\[io\\] {path}: io_uring reader unavailable"):
                _internal.ExpertReaderTest("uring", path)
    finally:
        os.unlink(path)


def test_refused_o_direct_fallback(random_file):
    """Simulated refusal (test knob): auto falls back to pread and says why; uring raises."""
    auto = _internal.ExpertReaderTest("auto", str(random_file), refuse_o_direct=True)
    assert auto.name == "pread"
    assert ("O_DIRECT refused" if _internal.uring_compiled() else "not compiled") in auto.describe
    assert auto.read([(5, 10, "demand")]) == [python_read(random_file, 5, 10)]
    if _internal.uring_compiled():
        with pytest.raises(_core.UnsupportedError, match="O_DIRECT refused"):
            _internal.ExpertReaderTest("uring", str(random_file), refuse_o_direct=True)


def test_uring_compiled_matches_reader_availability(random_file):
    if not _internal.uring_compiled():
        with pytest.raises(_core.UnsupportedError, match="not compiled"):
            _internal.ExpertReaderTest("uring", str(random_file))
        assert _internal.ExpertReaderTest("auto", str(random_file)).name == "pread"
    else:
        reader = open_reader("uring", random_file)
        assert reader.name == "io_uring"
        assert "O_DIRECT" in reader.describe


def _io_uring_fds():
    """{fd: /proc/self/fdinfo text} of every io_uring instance this process holds."""
    rings = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[io_uring]":
                with open(f"/proc/self/fdinfo/{fd}") as f:
                    rings[int(fd)] = f.read()
        except OSError:
            pass  # the directory's own descriptor, or one closed meanwhile
    return rings


@pytest.mark.skipif(
    not URING_REQUIRED, reason="io_uring reader not required here (not Linux, or SHARPI_ALLOW_NO_URING=1)"
)
def test_uring_reader_is_built_and_reads_through_io_uring(random_file):
    """Linux builds always have the io_uring reader (raw system calls, no liburing); "uring" and
    "auto" both run it on this test directory; and its reads really go through an io_uring: the
    kernel's own counters for the reader's ring (/proc/self/fdinfo) count one CQE per chunk."""
    assert _internal.uring_compiled(), "Linux build without the io_uring reader"
    assert _internal.reader_choice(str(random_file))["reader"] == "io_uring"
    assert _internal.ExpertReaderTest("auto", str(random_file)).name == "io_uring"
    before = set(_io_uring_fds())
    reader = open_reader("uring", random_file, chunk_bytes=4096)
    assert reader.name == "io_uring"
    assert re.match(
        r"io_uring: O_DIRECT, registered buffers \(64 MiB arena in 1 piece\), registered files, ",
        reader.describe,
    )
    rings = {fd: info for fd, info in _io_uring_fds().items() if fd not in before}
    assert len(rings) == 1, rings
    [(fd, info)] = rings.items()
    assert "UserBufs:\t1" in info and "UserFiles:\t2" in info, info  # the arena; O_DIRECT + plain fd
    head = re.search(r"^CqHead:\s*(\d+)", info, re.MULTILINE)
    offset, length = 5000, 40 * 4096  # aligned span [4096, 172032): 41 chunks of 4 KiB
    assert reader.read([(offset, length, "demand")]) == [python_read(random_file, offset, length)]
    if head is not None:  # the counters are in fdinfo since Linux 5.18
        with open(f"/proc/self/fdinfo/{fd}") as f:
            after = int(re.search(r"^CqHead:\s*(\d+)", f.read(), re.MULTILINE).group(1))
        assert after - int(head.group(1)) >= 41


@pytest.mark.parametrize("err", ["EPERM", "ENOSYS", "EINVAL"])
def test_refused_io_uring_setup_falls_back_and_says_why(err, random_file, monkeypatch):
    """SHARPI_FAULT_URING_SETUP (read at construction) makes io_uring_setup fail as a seccomp filter
    (EPERM, ENOSYS), kernel.io_uring_disabled (EPERM) or an old kernel (EINVAL) would: "auto" reads
    with pread and its description says why; "uring" raises; reader_choice reports the same."""
    if not _internal.uring_compiled():
        uring_unavailable("not compiled into this build")
    monkeypatch.setenv("SHARPI_FAULT_URING_SETUP", err)
    why = f"io_uring_setup: {os.strerror(getattr(errno, err))}"
    auto = _internal.ExpertReaderTest("auto", str(random_file))
    assert auto.name == "pread"
    assert auto.describe.endswith(f"(io_uring unavailable: {why})"), auto.describe
    assert auto.read([(4090, 20, "demand")]) == [python_read(random_file, 4090, 20)]
    with pytest.raises(_core.UnsupportedError, match=re.escape(f"io_uring reader unavailable: {why}")):
        _internal.ExpertReaderTest("uring", str(random_file))
    assert _internal.reader_choice(str(random_file)) == {"reader": "pread", "why": f"io_uring unavailable: {why}"}
    monkeypatch.setenv("SHARPI_FAULT_URING_SETUP", "EPRM")
    with pytest.raises(
        _core.InvalidArgument, match="SHARPI_FAULT_URING_SETUP: not an errno name or number: 'EPRM'"
    ):
        _internal.ExpertReaderTest("auto", str(random_file))
    monkeypatch.delenv("SHARPI_FAULT_URING_SETUP")
    assert open_reader("uring", random_file).name == "io_uring"


def test_inspect_names_the_reader_and_why(tiny_gguf, monkeypatch):
    """`sharpi inspect` says which reader --reader auto runs on the file, and why."""
    from sharpi.inspect_model import inspect_report, inspect_summary

    monkeypatch.delenv("SHARPI_FAULT_URING_SETUP", raising=False)
    if URING_REQUIRED:
        line = (
            "expert reader (--reader auto): io_uring (io_uring_setup and O_DIRECT reads through the ring work"
        )
        assert line in inspect_report(tiny_gguf)
    if _internal.uring_compiled():
        monkeypatch.setenv("SHARPI_FAULT_URING_SETUP", "ENOSYS")
        assert inspect_summary(tiny_gguf)["expert_reader"] == {
            "reader": "pread",
            "why": f"io_uring unavailable: io_uring_setup: {os.strerror(errno.ENOSYS)}",
        }
        assert (
            "expert reader (--reader auto): pread (io_uring unavailable: io_uring_setup: "
            in inspect_report(tiny_gguf, list_tensors=False)
        )


@pytest.mark.parametrize("kind", KINDS)
def test_file_shrunk_after_open_is_a_typed_error(kind, tmp_path):
    """A file truncated under an open reader: reads inside what is left still return the file's
    bytes; a read past the new end is an IoError naming the file and the requested range."""
    path = tmp_path / "shrinks.bin"
    data = bytes(np.random.default_rng(21).integers(0, 256, 3 * 2**20 + 100, dtype=np.uint8))
    path.write_bytes(data)
    reader = open_reader(kind, path, chunk_bytes=65536)
    assert reader.read([(10, 5000, "demand")]) == [data[10:5010]]
    new_size = 1_000_123
    os.truncate(path, new_size)
    inside = (new_size - 70_000, 70_000, "demand")  # ends exactly at the new end, unaligned
    assert reader.read([inside]) == [data[new_size - 70_000 : new_size]]
    with pytest.raises(_core.IoError) as info:
        reader.read([(900_000, 500_000, "prefetch")])
    assert re.fullmatch(
        re.escape(f"[io] {path}: read of [{900_000:#x}, {1_400_000:#x}) failed: end of file at ")
        + "0x[0-9a-f]+",
        str(info.value),
    ), str(info.value)
    assert reader.outstanding == 0


@pytest.mark.parametrize("kind", ["pread", "uring", "auto"])
def test_missing_file_is_io_error(kind, tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(_core.IoError, match=f"\\[io\\] {missing}: cannot open: No such file"):
        _internal.ExpertReaderTest(kind, str(missing))


def test_bad_arguments(random_file):
    with pytest.raises(_core.InvalidArgument, match="unknown reader kind 'mmap'"):
        _internal.ExpertReaderTest("mmap", str(random_file))
    with pytest.raises(_core.InvalidArgument, match="queue_depth"):
        _internal.ExpertReaderTest("pread", str(random_file), queue_depth=-1)
    reader = _internal.ExpertReaderTest("auto", str(random_file))
    with pytest.raises(_core.InvalidArgument, match="length is 0"):
        reader.read([(10, 0, "demand")])
    with pytest.raises(_core.InvalidArgument, match="overflows 64 bits"):
        reader.submit(1, 2**64 - 10, 5, "demand")
    with pytest.raises(_core.InvalidArgument, match="priority must be 'demand' or 'prefetch'"):
        reader.read([(10, 1, "urgent")])
    reader.plug()
    reader.submit(7, 0, 10, "demand")
    with pytest.raises(_core.InvalidArgument, match="tag 7"):
        reader.submit(7, 100, 10, "demand")
    assert completion_order(reader) == [7]  # reap(wait) unplugs
    assert reader.data(7) == python_read(random_file, 0, 10)


@pytest.mark.concurrency
@pytest.mark.parametrize("kind", KINDS)
def test_destroy_with_reads_outstanding(kind, random_file):
    """Destroying a reader with queued and in-flight reads neither hangs nor crashes; run in a child
    process so a hang or a write into freed memory cannot take the test session down with it."""
    if kind == "uring":
        open_reader(kind, random_file)  # fails (or skips, see reader_policy.py) when unavailable
    script = textwrap.dedent(
        f"""
        import gc
        from sharpi import _internal
        for round in range(20):
            r = _internal.ExpertReaderTest({kind!r}, {str(random_file)!r}, arena_bytes=64 << 20,
                                       queue_depth=2, pread_threads=2, chunk_bytes=16384)
            if round % 2:
                r.plug()
            for tag in range(40):
                r.submit(tag, tag * 100_003, 1 << 20, "prefetch" if tag % 2 else "demand")
            if round % 3 == 0:
                r.reap(False)
            del r
            gc.collect()
        print("clean")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "clean"


@pytest.mark.concurrency
@pytest.mark.parametrize("kind", KINDS)
def test_reap_without_wait_and_drain(kind, random_file):
    reader = open_reader(kind, random_file, queue_depth=4, pread_threads=2)
    assert reader.reap(False) == []
    assert reader.reap(True) == []  # nothing outstanding: returns at once
    for tag in range(30):
        reader.submit(tag, tag * 200_000 + 5, 150_000, "prefetch")
    seen = []
    while reader.outstanding:
        seen += [t for t, ok, _ in reader.reap(False) if ok]
        seen += [t for t, ok, _ in reader.reap(True) if ok]
    assert sorted(seen) == list(range(30))
    for tag in range(30):
        assert reader.data(tag) == python_read(random_file, tag * 200_000 + 5, 150_000)
    gc.collect()


# The request queue both readers share, driven one chunk at a time: the scheduling rules with no
# threads and no timing. Expected values are worked out by hand from the contract.


def drain_chunks(queue):
    chunks = []
    while (c := queue.next_chunk()) is not None:
        chunks.append(c)
    return chunks


def test_queue_chunks_cover_the_aligned_superset():
    q = _internal.ReadQueueTest(chunk_bytes=8192, depth=64)
    q.add(1, 5000, 20_000, "demand")  # span [4096, 28672): 3 chunks of 8192
    q.add(2, 40_960, 4096, "prefetch")  # aligned already: one block
    q.add(3, 100_000, 1, "prefetch")  # one byte: its block
    chunks = drain_chunks(q)
    assert chunks == [
        (1, 4096, 12288),
        (1, 12288, 20480),
        (1, 20480, 28672),
        (2, 40960, 45056),
        (3, 98304, 102400),
    ]
    assert q.in_flight == 5
    for tag, begin, _ in chunks:
        q.finish_chunk(tag, begin, 0, _)
    assert sorted(q.take()) == [(1, True, ""), (2, True, ""), (3, True, "")]
    assert q.outstanding == 0


def test_queue_chunk_size_rounds_up_to_blocks():
    q = _internal.ReadQueueTest(chunk_bytes=5000, depth=8)  # -> 8192
    q.add(1, 0, 20_000)
    assert drain_chunks(q) == [(1, 0, 8192), (1, 8192, 16384), (1, 16384, 20480)]


def test_queue_depth_and_demand_first_at_chunk_granularity():
    q = _internal.ReadQueueTest(chunk_bytes=4096, depth=2)
    q.add(1, 0, 4 * 4096, "prefetch")  # 4 chunks
    q.add(2, 10 * 4096, 4096, "prefetch")
    assert drain_chunks(q) == [(1, 0, 4096)]  # prefetch: at most max(1, depth // 4) = 1 in flight
    q.add(3, 20 * 4096 + 7, 10, "demand")  # arrives while prefetch 1 is being read
    assert q.next_chunk() == (3, 20 * 4096, 21 * 4096)  # a demand may use the whole depth
    assert q.next_chunk() is None  # full
    q.finish_chunk(1, 0, 0, 4096)
    assert q.next_chunk() is None  # one chunk (the demand) in flight: the prefetch limit
    q.finish_chunk(3, 20 * 4096, 0, 21 * 4096)
    assert q.take() == [(3, True, "")]
    for begin in (4096, 8192, 12288):
        assert drain_chunks(q) == [(1, begin, begin + 4096)]
        q.finish_chunk(1, begin, 0, begin + 4096)
    assert q.take() == [(1, True, "")]  # only once its last chunk is back
    assert drain_chunks(q) == [(2, 40960, 45056)]


def test_queue_prefetch_keeps_most_of_the_depth_for_demand():
    q = _internal.ReadQueueTest(chunk_bytes=4096, depth=8)
    for tag in range(20):
        q.add(tag, tag * 4096, 4096, "prefetch")
    assert len(drain_chunks(q)) == 2  # max(1, 8 // 4)
    for tag in range(100, 107):
        q.add(tag, tag << 20, 4096, "demand")
    assert [c[0] for c in drain_chunks(q)] == list(range(100, 106))  # demand fills the depth
    q.finish_chunk(0, 0, 0, 4096)
    assert q.next_chunk()[0] == 106
    q.finish_chunk(1, 4096, 0, 8192)
    assert q.next_chunk() is None  # 7 in flight, prefetch limit 2


def test_queue_cancel_promote_and_plug():
    q = _internal.ReadQueueTest(chunk_bytes=4096, depth=1)
    q.set_plugged(True)
    for tag in range(4):
        q.add(tag, tag * 8192, 8192, "prefetch")  # 2 chunks each
    q.add(9, 1 << 20, 10, "demand")
    assert q.next_chunk() is None  # plugged
    assert q.cancel(1) is True
    q.promote(3)
    q.set_plugged(False)
    assert q.next_chunk() == (9, 1 << 20, (1 << 20) + 4096)
    q.finish_chunk(9, 1 << 20, 0, (1 << 20) + 4096)
    assert q.next_chunk() == (3, 3 * 8192, 3 * 8192 + 4096)  # promoted: demand now
    q.finish_chunk(3, 3 * 8192, 0, 3 * 8192 + 4096)
    assert q.next_chunk() == (3, 3 * 8192 + 4096, 4 * 8192)
    q.finish_chunk(3, 3 * 8192 + 4096, 0, 4 * 8192)
    assert q.next_chunk() == (0, 0, 4096)
    assert q.cancel(0) is False  # started
    q.finish_chunk(0, 0, 0, 4096)
    q.promote(2)  # a queued prefetch while 0 is half done: 2 goes first now
    assert q.next_chunk() == (2, 16384, 20480)
    assert q.cancel(2) is False
    q.finish_chunk(2, 16384, 0, 20480)
    rest = []
    while (c := q.next_chunk()) is not None:
        rest.append(c)
        q.finish_chunk(c[0], c[1], 0, c[2])
    assert rest == [(2, 20480, 24576), (0, 4096, 8192)]
    assert [t for t, ok, _ in q.take()] == [9, 3, 2, 0]  # 1 was cancelled: no completion
    assert q.outstanding == 0


def test_queue_partly_started_prefetch_promoted():
    q = _internal.ReadQueueTest(chunk_bytes=4096, depth=1)
    q.add(1, 0, 3 * 4096, "prefetch")
    q.add(2, 1 << 20, 4096, "demand")
    assert q.next_chunk() == (2, 1 << 20, (1 << 20) + 4096)
    q.finish_chunk(2, 1 << 20, 0, (1 << 20) + 4096)
    assert q.next_chunk() == (1, 0, 4096)
    q.add(3, 2 << 20, 4096, "prefetch")
    q.add(4, 3 << 20, 4096, "demand")
    q.promote(1)  # behind demand 4, ahead of prefetch 3
    q.finish_chunk(1, 0, 0, 4096)
    order = []
    while (c := q.next_chunk()) is not None:
        order.append(c[:2])
        q.finish_chunk(c[0], c[1], 0, c[2])
    assert order == [(4, 3 << 20), (1, 4096), (1, 8192), (3, 2 << 20)]


def test_queue_error_waits_for_chunks_in_flight_and_stops_the_rest():
    q = _internal.ReadQueueTest(chunk_bytes=4096, depth=2, path="/models/x.gguf")
    q.add(1, 100, 5 * 4096, "demand")  # span [0, 24576): 6 chunks
    assert drain_chunks(q) == [(1, 0, 4096), (1, 4096, 8192)]
    q.finish_chunk(1, 4096, 5, 4096)  # EIO
    assert q.take() == []  # chunk 0 is still being read into the buffer
    assert q.next_chunk() is None  # a failed request starts no more chunks
    q.finish_chunk(1, 0, 0, 4096)
    [(tag, ok, error)] = q.take()
    assert (tag, ok) == (1, False)
    assert error == f"[io] /models/x.gguf: read of [0x64, 0x5064) failed: {os.strerror(5)}"
    assert q.in_flight == 0
    assert q.outstanding == 0


def test_queue_end_of_file_rules():
    q = _internal.ReadQueueTest(chunk_bytes=8192, depth=8, path="f.bin")
    # File of 10_000 bytes. Range inside it: the last chunk stops early at 10_000 and that is fine.
    q.add(1, 9000, 1000, "demand")  # span [8192, 12288), wanted up to 10_000
    q.add(2, 9000, 1001, "demand")  # wants one byte past the end
    q.add(3, 20_000, 5, "demand")  # starts past the end
    for tag, begin, _ in drain_chunks(q):
        q.finish_chunk(tag, begin, 0, max(10_000, begin))  # reads stop at the end of the file
    done = {tag: (ok, error) for tag, ok, error in q.take()}
    assert done[1] == (True, "")
    assert done[2] == (False, "[io] f.bin: read of [0x2328, 0x2711) failed: end of file at 0x2710")
    assert done[3] == (False, "[io] f.bin: read of [0x4e20, 0x4e25) failed: end of file at 0x4000")


def test_queue_fault_hook_fails_covering_chunks_only(monkeypatch):
    monkeypatch.setenv("SHARPI_FAULT_EIO_AT", str(3 * 4096 + 10))
    q = _internal.ReadQueueTest(chunk_bytes=4096, depth=8, path="g")
    q.add(1, 0, 3 * 4096 + 10, "demand")  # ends just before the fault, same block: fine
    q.add(2, 3 * 4096 + 10, 1, "demand")  # the faulty byte
    q.add(3, 2 * 4096, 2 * 4096, "demand")  # covers it in its second chunk
    chunks = drain_chunks(q)
    assert (2, 3 * 4096, 4 * 4096) not in chunks  # failed without being handed out
    assert (3, 3 * 4096, 4 * 4096) not in chunks
    for tag, begin, end in chunks:
        q.finish_chunk(tag, begin, 0, end)
    done = {tag: (ok, error) for tag, ok, error in q.take()}
    assert done[1] == (True, "")
    assert done[2] == (False, f"[io] g: read of [0x300a, 0x300b) failed: {os.strerror(5)}")
    assert done[3] == (False, f"[io] g: read of [0x2000, 0x4000) failed: {os.strerror(5)}")


def test_queue_shutdown_drops_queued_and_finishes_started():
    q = _internal.ReadQueueTest(chunk_bytes=4096, depth=1, path="h")
    q.add(1, 0, 2 * 4096, "demand")
    q.add(2, 1 << 20, 10, "prefetch")
    assert q.next_chunk() == (1, 0, 4096)
    q.drop_queued()
    assert q.next_chunk() is None
    assert q.take() == []  # 1 still has a chunk in flight
    q.finish_chunk(1, 0, 0, 4096)
    assert q.take() == [(1, False, "[io] h: reader shut down")]
    assert q.outstanding == 0  # 2 was forgotten


def test_queue_rejects_bad_requests():
    q = _internal.ReadQueueTest(chunk_bytes=0, depth=0)
    q.add(1, 0, 10)
    with pytest.raises(_core.InvalidArgument, match="tag 1.*already outstanding"):
        q.add(1, 0, 10)
    with pytest.raises(_core.InvalidArgument, match="length is 0"):
        q.add(2, 0, 0)
    with pytest.raises(_core.InvalidArgument, match="overflows 64 bits"):
        q.add(3, 2**64 - 4096, 1)



# The I/O threads' scheduling (reader_common.h, raise_io_thread_priority): what describe() says must
# be what the kernel applied, read back from /proc/self/task/*/stat (rt_priority and policy, fields 40
# and 41 of proc(5)). Each case runs in a fresh process, so the environment and the caller's own
# policy are the test's.
_PRIORITY_SCRIPT = textwrap.dedent(
    """
    import os, re, sys
    from sharpi import _core, _internal
    if sys.argv[3] != "0":
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(int(sys.argv[3])))
        except PermissionError:
            print("no permission"); sys.exit(0)
    r = _internal.ExpertReaderTest(sys.argv[1], sys.argv[2])
    m = re.search(r"I/O threads? (SCHED_FIFO \\d+|normal priority \\([^)]*\\))", r.describe)
    print(m.group(1) if m else r.describe)
    print(r.name)
    levels = []
    for tid in os.listdir("/proc/self/task"):
        stat = open(f"/proc/self/task/{tid}/stat").read()
        fields = stat[stat.rindex(")") + 2 :].split()  # fields[0] is field 3 (state)
        if int(fields[41 - 3]) == os.SCHED_FIFO:
            levels.append(int(fields[40 - 3]))
    print(" ".join(map(str, sorted(levels))))
    """
)


def _io_priority(kind, path, env=None, caller_level=0):
    """(what describe() says, the reader's name, the FIFO levels of the process's threads)."""
    out = subprocess.run(
        [sys.executable, "-c", _PRIORITY_SCRIPT, kind, str(path), str(caller_level)],
        check=False, env=dict(os.environ, **(env or {})), capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines() + ["", ""]
    return lines[0], lines[1], [int(x) for x in lines[2].split()]


@pytest.mark.parametrize("kind", ["pread", "auto"])
def test_io_threads_run_at_the_priority_describe_reports(kind, random_file):
    said, name, levels = _io_priority(kind, random_file)
    n_io = 1 if name == "io_uring" else 2  # the ring's thread, or the pread workers
    if said.startswith("SCHED_FIFO"):
        assert (said, levels) == ("SCHED_FIFO 1", [1] * n_io)
    else:  # no privilege: nothing changed
        assert said.startswith("normal priority (SCHED_FIFO refused: ") and levels == [], (said, levels)
    # Opting out: nothing is asked.
    assert _io_priority(kind, random_file, {"SHARPI_IO_REALTIME": "0"})[::2] == (
        "normal priority (SHARPI_IO_REALTIME=0)", [])
    # A real-time caller (`chrt -f 5`): its I/O threads one level above it, so compute cannot starve them.
    said, name, levels = _io_priority(kind, random_file, caller_level=5)
    if said != "no permission":
        assert (said, levels) == ("SCHED_FIFO 6", [5] + [6] * n_io)
