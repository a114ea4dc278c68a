"""Both expert readers run on every run of the suite.

On Linux the io_uring reader is always built (raw system calls and <linux/io_uring.h>, no liburing),
so a test that cannot use it FAILS, saying why, instead of skipping: a skipped io_uring test would
hide exactly what the suite is there to check. Where io_uring is blocked on purpose (a container
whose seccomp profile refuses io_uring_setup, kernel.io_uring_disabled=2), SHARPI_ALLOW_NO_URING=1
turns those failures into skips; conftest.py fails the session on any io_uring skip without it.
"""

from __future__ import annotations

import os
import sys

import pytest

URING_REQUIRED = sys.platform.startswith("linux") and os.environ.get("SHARPI_ALLOW_NO_URING") != "1"


def uring_unavailable(why: str):
    """Fails the test (skips it when io_uring is not required here)."""
    message = f"io_uring reader unavailable: {why}"
    if URING_REQUIRED:
        pytest.fail(f"{message} (on Linux both readers must run; SHARPI_ALLOW_NO_URING=1 skips instead)")
    pytest.skip(message)
