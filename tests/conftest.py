"""Shared pytest fixtures. Kept small and generic: anything model-specific lives in tests/reference/.

`tests/` is put on sys.path so that test modules can `from reference import ...` whether or not the
directory is a package, and whichever directory pytest is started from.
"""

import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """One scratch directory per test session for generated and converted model files, shared by
    all test modules so an expensive file (e.g. a converter run) is made at most once."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture
def shared_traces() -> Path:
    """../shared/traces (shared_data.py), or a skip saying it is absent (a failure in CI)."""
    from ci_policy import prerequisite_missing
    from shared_data import TRACES_DIR

    if not TRACES_DIR.is_dir():
        prerequisite_missing(f"../shared/traces is absent ({TRACES_DIR}): real routing traces sit beside the "
                             "repository, not in it")  # fmt: skip
    return TRACES_DIR


def pytest_collection_modifyitems(config, items):
    # Every test that reads ../shared is marked, so `.ci/run` can run exactly those without it.
    for item in items:
        if "shared_traces" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.shared_data)


# The io_uring reader must run on every run of the suite on Linux (reader_policy.py): any skipped
# test whose skip reason mentions io_uring fails the session, even if the skip came from a path that
# does not go through reader_policy.uring_unavailable. The reason, not the test's name: a test named
# for both readers may skip for a reason that has nothing to do with io_uring (../shared absent).
_uring_skips: list[str] = []


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if "uring" in reason.lower():
            _uring_skips.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    from reader_policy import URING_REQUIRED

    if URING_REQUIRED and _uring_skips:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    from reader_policy import URING_REQUIRED

    if URING_REQUIRED and _uring_skips:
        terminalreporter.section("io_uring tests were skipped: the suite fails (see tests/reader_policy.py)")
        for line in _uring_skips:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def converter() -> Path:
    """The directory of llama.cpp's convert_hf_to_gguf.py (tools/fetch_converter.sh), with torch and
    transformers >= 5 to build the checkpoints it converts; skips when any of them is unavailable."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers", minversion="5.0")
    from reference import hf_export

    try:
        return hf_export.converter_dir()
    except hf_export.ConverterUnavailable as error:
        pytest.skip(f"llama.cpp converter unavailable: {error}")


@pytest.fixture(scope="session")
def vocab_fixtures_dir() -> Path:
    """llama.cpp's tokenizer fixtures (models/ggml-vocab-*.gguf with .inp/.out cases), unpacked by
    tools/fetch_converter.sh; skips when the llama-cpp-python source package cannot be fetched."""
    from reference import hf_export

    try:
        d = hf_export.converter_dir() / "models"
    except hf_export.ConverterUnavailable as error:
        pytest.skip(f"llama.cpp source package unavailable: {error}")
    if not d.is_dir():
        pytest.fail(f"{d} is missing: tools/fetch_converter.sh should have unpacked the fixtures")
    return d
