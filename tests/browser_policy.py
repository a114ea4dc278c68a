"""Where the browser test finds Chromium, and what happens when it is not there.

The page test (test_serve_page.py::test_page_in_headless_chromium) drives Debian's chromium and
chromium-driver packages, never a downloaded browser. A machine without them skips it, saying why;
.ci/run installs both and sets SHARPI_REQUIRE_BROWSER=1, which turns that skip into a failure, so
a CI run can never pass with the browser test silently left out.
"""

from __future__ import annotations

import os

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
BROWSER_REQUIRED = os.environ.get("SHARPI_REQUIRE_BROWSER") == "1"


def chromium_or_skip() -> None:
    """Skips the calling test (fails it when BROWSER_REQUIRED) unless both binaries are installed."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if not missing:
        return
    why = (f"headless browser test: {' and '.join(missing)} not installed "
           "(apt-get install chromium chromium-driver; .ci/run installs them)")
    if BROWSER_REQUIRED:
        pytest.fail(f"{why}, and SHARPI_REQUIRE_BROWSER=1 requires them")
    pytest.skip(why)
