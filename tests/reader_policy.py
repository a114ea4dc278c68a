"""Both expert readers run on every run of the suite.

On Linux the io_uring reader is always built (raw system calls and <linux/io_uring.h>, no liburing),
so a test that cannot use it FAILS, saying why, instead of skipping: a skipped io_uring test would
hide exactly what the suite is there to check. Where io_uring is blocked on purpose (a container
whose seccomp profile refuses io_uring_setup, kernel.io_uring_disabled=2), SHARPI_ALLOW_NO_URING=1
turns those failures into skips, except under SHARPI_REQUIRE_ALL=1 (CI, ci_policy.py), where
nothing may skip; conftest.py fails the session on any io_uring skip while it is required.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from ci_policy import REQUIRE_ALL, prerequisite_missing

URING_REQUIRED = sys.platform.startswith("linux") and (
    REQUIRE_ALL or os.environ.get("SHARPI_ALLOW_NO_URING") != "1"
)


def uring_unavailable(why: str) -> NoReturn:
    """Fails the test (skips it when io_uring is not required here)."""
    prerequisite_missing(
        f"io_uring reader unavailable: {why}",
        required=URING_REQUIRED,
        rule="on Linux both readers must run; SHARPI_ALLOW_NO_URING=1 skips instead, unless SHARPI_REQUIRE_ALL=1",
    )
