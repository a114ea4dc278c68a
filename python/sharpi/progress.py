"""Progress bars for the long steps of the command line: model loading, make-model's tensor writing,
bench runs, trace prompts, predictor training epochs (tqdm).

What it owns: whether a bar is shown, and where. Bars go to stderr only, so they never touch what a
command prints on stdout (tables, JSON, generated text that tests and pipes parse). They are shown
when stderr is a terminal; SHARPI_PROGRESS=1 forces them on (a log file that wants them),
SHARPI_PROGRESS=0 turns them off. A disabled bar is tqdm's own no-op: iterating it yields the same
items and update() does nothing, so callers never branch on whether bars are on.
"""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager

from tqdm import tqdm

# A step shorter than this shows no bar at all (tqdm's delay): a quick load or a small model prints
# nothing, so short commands keep a clean terminal.
SHOW_AFTER_S = 1.0


def enabled() -> bool:
    """True when bars are drawn: SHARPI_PROGRESS=1 / 0 decides, else whether stderr is a terminal."""
    forced = os.environ.get("SHARPI_PROGRESS", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def bar(iterable=None, *, desc: str, total: float | None = None, unit: str = "it", **options) -> tqdm:
    """A tqdm bar on stderr, shown only once its step has run SHOW_AFTER_S; disabled when
    enabled() says so or the caller passes disable=True. unit="B" counts bytes with binary prefixes
    (KiB, MiB, GiB)."""
    disable = options.pop("disable", False) or not enabled()
    if unit == "B":
        options.setdefault("unit_scale", True)
        options.setdefault("unit_divisor", 1024)
    return tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr, disable=disable,
                delay=SHOW_AFTER_S, dynamic_ncols=True, **options)


def write(message: str) -> None:
    """One line on stderr that does not tear a bar being drawn (tqdm.write moves it below). While
    every bar is still inside its delay the line is printed plainly: tqdm.write would redraw those
    bars early, with a count that tqdm has not brought up to date yet."""
    drawn = [b for b in list(getattr(tqdm, "_instances", ())) if not b.disable and b._time() - b.start_t >= b.delay]
    if drawn:
        tqdm.write(message, file=sys.stderr)
    else:
        print(message, file=sys.stderr, flush=True)


def _bytes_read_by_this_process() -> int | None:
    """rchar of /proc/self/io: bytes this process got from read()/pread() (page cache included,
    mmap faults not). None where the file does not exist (not Linux) or cannot be read."""
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


@contextmanager
def loading(path: str, total: int | None = None, poll_s: float = 0.2, disable: bool = False):
    """While the block runs (a Session being built, which releases the GIL), a bar on stderr with the
    elapsed time and the bytes read since it started, out of `total` when given: a streamed session
    reads its dense weights with pread (sharpi/cpp/src/model/model.cpp), so the count is the load's
    progress; a resident one maps the file and is done before the bar would show. The bar is erased
    when the block ends."""
    shown = bar(desc=f"loading {os.path.basename(path)}", total=total, unit="B", leave=False, disable=disable)
    if shown.disable:
        yield
        return
    start = _bytes_read_by_this_process()
    done = threading.Event()

    def watch() -> None:
        counted = 0
        while not done.wait(poll_s):
            now = _bytes_read_by_this_process()
            # The header and metadata are read too: never count past the total (tqdm would drop it).
            read = None if start is None or now is None else min(now - start, total or now - start)
            if read is not None and read > counted:
                shown.update(read - counted)
                counted = read
            else:
                shown.refresh()

    watcher = threading.Thread(target=watch, name="sharpi-load-progress", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        shown.close()


def open_session(path: str, **options):
    """sharpi.Session(path, **options) with loading()'s bar while it is built. A streamed session
    (a RAM budget) reads the dense weights, whose size the memory plan gives: the bar's total."""
    import sharpi

    total = None
    if options.get("ram_budget") and enabled():
        try:  # the file is only mapped; a file the plan refuses gets the Session's own error below
            total = sharpi._internal.memory_plan(path, allow_long_context=True)["dense_bytes"]
        except sharpi._core.SharpiError:
            pass
    with loading(path, total=total):
        return sharpi.Session(path, **options)

