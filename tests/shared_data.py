"""Where the tests find ../shared: real models' routing traces (shared/traces/README.md), which sit
beside the repository, not in it.

A fresh clone has no ../shared, and the README's test command must still pass there: a test that
reads a trace takes the `shared_traces` fixture (conftest.py), which gives TRACES_DIR or skips the
test saying that ../shared is absent (under SHARPI_REQUIRE_ALL=1 that skip is a failure, as every
missing prerequisite is: ci_policy.py). conftest.py marks every such test `shared_data`, and a test
that only looks at the traces when they are there (the bench smoke tests replay one if present)
carries the mark itself; `.ci/run` runs `-m shared_data` once more in a clone with no ../shared.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED_DIR = REPO.parent / "shared"
TRACES_DIR = SHARED_DIR / "traces"
