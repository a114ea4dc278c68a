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
from xml.etree import ElementTree

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


def run_child(tmp_path: Path, **env_overrides: str) -> tuple[subprocess.CompletedProcess, dict]:
    """Runs CHILD_TESTS in a child pytest; returns the process and each test's (outcome, message)
    from its JUnit XML report, a format pytest keeps stable (its terminal output changes between
    releases: pytest 9 repeats failure messages that pytest 8 printed once)."""
    (tmp_path / "test_child.py").write_text(CHILD_TESTS)
    report = tmp_path / "report.xml"
    env = {k: v for k, v in os.environ.items() if k not in ("SHARPI_REQUIRE_ALL", "SHARPI_ALLOW_NO_URING")}
    env.update(env_overrides)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         f"--junitxml={report}", str(tmp_path / "test_child.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    outcomes = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        result = next((e for e in case if e.tag in ("failure", "error", "skipped")), None)
        outcome = "passed" if result is None else {"failure": "failed"}.get(result.tag, result.tag)
        message = "" if result is None else (result.get("message") or "") + (result.text or "")
        outcomes[case.get("name")] = (outcome, message)
    return done, outcomes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the io_uring rule differs off Linux")
def test_missing_prerequisites_skip_locally_and_fail_under_require_all(tmp_path):
    names = {"test_generic", "test_module", "test_browser", "test_uring"}

    # Locally (io_uring opted out, as in a container that blocks it): every test skips with its reason.
    local, outcomes = run_child(tmp_path, SHARPI_ALLOW_NO_URING="1")
    assert local.returncode == 0, local.stdout + local.stderr
    assert {name for name, (outcome, _) in outcomes.items() if outcome == "skipped"} == names, outcomes
    assert "a tool this test needs is not installed" in outcomes["test_generic"][1]
    assert "/nonexistent/chromium" in outcomes["test_browser"][1] and "not installed" in outcomes["test_browser"][1]

    # In CI: the same four fail, each naming the rule that requires it, and pytest exits non-zero.
    # The io_uring opt-out does not apply there.
    ci, outcomes = run_child(tmp_path, SHARPI_REQUIRE_ALL="1", SHARPI_ALLOW_NO_URING="1")
    assert ci.returncode == 1, ci.stdout + ci.stderr
    assert {name for name, (outcome, _) in outcomes.items() if outcome == "failed"} == names, outcomes
    for name in ("test_generic", "test_module", "test_browser"):
        assert "SHARPI_REQUIRE_ALL=1: in CI this test must run" in outcomes[name][1], outcomes[name]
    assert "on Linux both readers must run" in outcomes["test_uring"][1]

    # Only "1" turns the switch on.
    off, outcomes = run_child(tmp_path, SHARPI_REQUIRE_ALL="0", SHARPI_ALLOW_NO_URING="1")
    assert off.returncode == 0, off.stdout
    assert {outcome for outcome, _ in outcomes.values()} == {"skipped"} and len(outcomes) == 4, outcomes


URING_RULE_CHILD = textwrap.dedent(
    """
    import pytest

    def test_uring_reader_on_a_shared_trace():
        pytest.skip("../shared/traces is absent (a fresh clone)")

    def test_streaming(request):
        if request.config.getoption("--uring-skip"):
            pytest.skip("uring reader unavailable here")
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the io_uring rule applies on Linux")
@pytest.mark.parametrize("uring_skip", [False, True])
def test_the_io_uring_rule_keys_on_the_skip_reason_not_the_test_name(tmp_path, uring_skip):
    """conftest.py fails a session in which an io_uring test skipped; a test whose name says uring but
    that skips for another reason (../shared absent on a fresh clone) must not trip it."""
    (tmp_path / "conftest.py").write_text(
        (TESTS_DIR / "conftest.py").read_text()
        + '\n\ndef pytest_addoption(parser):\n    parser.addoption("--uring-skip", action="store_true")\n'
    )
    (tmp_path / "test_child.py").write_text(URING_RULE_CHILD)
    env = {k: v for k, v in os.environ.items() if k not in ("SHARPI_REQUIRE_ALL", "SHARPI_ALLOW_NO_URING")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         *(["--uring-skip"] if uring_skip else []), str(tmp_path / "test_child.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if uring_skip:
        assert done.returncode == 1, done.stdout + done.stderr
        section = done.stdout.split("io_uring tests were skipped: the suite fails")[1].split("short test summary")[0]
        assert "test_child.py::test_streaming" in section and "uring reader unavailable here" in section
        assert "test_uring_reader_on_a_shared_trace" not in section
    else:
        assert done.returncode == 0, done.stdout + done.stderr
        assert "the suite fails" not in done.stdout


def readme_commands() -> dict[str, str]:
    """The command of each README section that holds one ```sh block with a single line: the set-up
    command and the test command."""
    text = (TESTS_DIR.parent / "README.md").read_text()
    out = {}
    for heading in ("## Set up and run the main job", "## Run the tests"):
        block = text.split(heading, 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
        (out[heading],) = block.strip().splitlines()
    return out


def test_ci_runs_the_readme_commands_verbatim_in_a_fresh_venv():
    """What CI proves is what a new user types: both README commands, as lines of .ci/run, after it
    has made a fresh venv (so nothing the machine already has can hide a missing step)."""
    ci = (TESTS_DIR.parent / ".ci" / "run").read_text().splitlines()
    commands = readme_commands()
    assert commands["## Set up and run the main job"].startswith("pip install . && sharpi run")
    assert "pip install ." not in commands["## Run the tests"], "running the tests must not rebuild sharpi"
    venv = ci.index("python3 -m venv .venv")
    for command in commands.values():
        # The command verbatim, alone on its line or followed by the "||" that makes a failure of any
        # of its parts stop the script (set -e skips all but the last command of an && list).
        lines = [i for i, line in enumerate(ci) if line == command or line.startswith(command + " || ")]
        assert lines, f".ci/run does not run the README's {command!r}"
        assert lines[0] > venv


def test_one_llama_cpp_version_for_the_peer_the_converter_and_ci():
    """The llama.cpp that the comparisons run (ci_policy.LLAMA_CPP_PYTHON, installed by .ci/run) is the
    one whose converter and quantizer the tests use (tools/fetch_converter.sh): one llama.cpp."""
    from ci_policy import LLAMA_CPP_PYTHON

    version = LLAMA_CPP_PYTHON.split("==")[1]
    assert f'"{LLAMA_CPP_PYTHON}"' in (TESTS_DIR.parent / ".ci" / "run").read_text()
    for tool in ("fetch_converter.sh", "build_llama_tools.sh"):
        assert f'version="{version}"' in (TESTS_DIR.parent / "tools" / tool).read_text(), tool
