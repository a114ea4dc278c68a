"""Where the browser test finds Chromium, and what happens when it is not there.

The page test (test_serve_page.py::test_page_in_headless_chromium) drives Debian's chromium and
chromium-driver packages, never a downloaded browser. A machine without them skips it, saying why;
.ci/run installs both and sets SHARPI_REQUIRE_ALL=1, which turns that skip into a failure
(ci_policy.py), so a CI run can never pass with the browser test silently left out.
"""

from __future__ import annotations

import os

from ci_policy import prerequisite_missing

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def chromium_or_skip() -> None:
    """Skips the calling test (fails it under SHARPI_REQUIRE_ALL=1) unless both binaries are installed."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if missing:
        prerequisite_missing(
            f"headless browser test: {' and '.join(missing)} not installed "
            "(apt-get install chromium chromium-driver; .ci/run installs them)"
        )
