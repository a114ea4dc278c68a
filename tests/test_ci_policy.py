"""The one switch that makes tests mandatory in CI (ci_policy.py): without SHARPI_REQUIRE_ALL=1 a
missing prerequisite skips the test, with it the same test fails, so `.ci/run` (set -e around
pytest) fails. Checked by running small test files in a child pytest, whose outcome counts and exit
status are the oracle, for each way a test reports a missing prerequisite: the generic helper, a
missing module, the browser check and the io_uring rule.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent

CHILD_TESTS = textwrap.dedent(
    """
    import sys

    import browser_policy
    import pytest
    from ci_policy import prerequisite_missing, require_module

    def test_generic():
        prerequisite_missing("a tool this test needs is not installed")

    def test_module():
        require_module("sharpi_no_such_module")

    def test_browser(monkeypatch):
        monkeypatch.setattr(browser_policy, "CHROMIUM", "/nonexistent/chromium")
        browser_policy.chromium_or_skip()

    @pytest.mark.skipif(not sys.platform.startswith("linux"), reason="io_uring exists on Linux only")
    def test_uring():
        from reader_policy import uring_unavailable

        uring_unavailable("refused by this test")
    """
)


def run_child(tmp_path: Path, **env_overrides: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_child.py").write_text(CHILD_TESTS)
    env = {k: v for k, v in os.environ.items() if k not in ("SHARPI_REQUIRE_ALL", "SHARPI_ALLOW_NO_URING")}
    env.update(env_overrides)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         str(tmp_path / "test_child.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def summary(done: subprocess.CompletedProcess) -> str:
    """pytest -q's last line without its timing: "4 skipped", "4 failed", "1 failed, 3 skipped"."""
    return done.stdout.strip().splitlines()[-1].rsplit(" in ", 1)[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the io_uring rule differs off Linux")
def test_missing_prerequisites_skip_locally_and_fail_under_require_all(tmp_path):
    # Locally (io_uring opted out, as in a container that blocks it): every test skips with its reason.
    local = run_child(tmp_path, SHARPI_ALLOW_NO_URING="1")
    assert local.returncode == 0, local.stdout + local.stderr
    assert summary(local) == "4 skipped", local.stdout
    assert "a tool this test needs is not installed" in local.stdout
    assert "/nonexistent/chromium not installed" in local.stdout

    # In CI: the same four fail, each naming the switch, and pytest exits non-zero. The io_uring
    # opt-out does not apply there.
    ci = run_child(tmp_path, SHARPI_REQUIRE_ALL="1", SHARPI_ALLOW_NO_URING="1")
    assert ci.returncode == 1, ci.stdout + ci.stderr
    assert summary(ci) == "4 failed", ci.stdout
    assert ci.stdout.count("SHARPI_REQUIRE_ALL=1: in CI this test must run") == 3, ci.stdout
    assert "on Linux both readers must run" in ci.stdout

    # Only "1" turns the switch on.
    off = run_child(tmp_path, SHARPI_REQUIRE_ALL="0", SHARPI_ALLOW_NO_URING="1")
    assert off.returncode == 0 and summary(off) == "4 skipped", off.stdout
