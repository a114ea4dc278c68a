"""In CI every test must run: a missing prerequisite is a failure there, not a skip.

Some tests need what a developer machine may lack: Debian's Chromium for the page test, node for the
page's script, llama.cpp's quantizer built from source, torch. Locally such a test skips and says
why. .ci/run installs all of them and sets SHARPI_REQUIRE_ALL=1, the one switch that turns each of
those skips into a failure, so a CI run can never pass with a test silently left out. Every test
that may lack a prerequisite says so through prerequisite_missing (or require_module), never through
pytest.skip directly.

The io_uring reader has a stricter rule of its own (reader_policy.py): required on every Linux run,
not only in CI.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import NoReturn

import pytest

SWITCH = "SHARPI_REQUIRE_ALL"
REQUIRE_ALL = os.environ.get(SWITCH) == "1"
CI_RULE = f"{SWITCH}=1: in CI this test must run"


def prerequisite_missing(why: str, *, required: bool = REQUIRE_ALL, rule: str = CI_RULE) -> NoReturn:
    """Skips the calling test, saying `why`; fails it instead when `required` (by default: under
    SHARPI_REQUIRE_ALL=1), naming the `rule` that requires it."""
    if required:
        pytest.fail(f"{why} ({rule}: a missing prerequisite is a failure, not a skip)")
    pytest.skip(why)


def require_module(name: str, minversion: str | None = None) -> ModuleType:
    """pytest.importorskip for a test CI must run: the module, or prerequisite_missing. Call it from a
    test or fixture, not at module level, where a failure would abort the whole collection."""
    try:
        return pytest.importorskip(name, minversion=minversion)
    except pytest.skip.Exception as skipped:
        why = str(skipped.msg)
    prerequisite_missing(why)  # outside the except: the failure is not shown chained to the skip


# The version tools/fetch_converter.sh downloads, so that the converter and the peer are one llama.cpp.
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"


def require_llama_cpp() -> ModuleType:
    """llama-cpp-python, the independent implementation several tests compare with: the module, or
    prerequisite_missing saying how to get it (it is no extra of the tests: pip compiles llama.cpp
    for it, several minutes; .ci/run installs it)."""
    try:
        import llama_cpp
    except ImportError as error:
        why = f"llama_cpp is not importable ({error}): pip install {LLAMA_CPP_PYTHON} (compiles llama.cpp)"
    else:
        return llama_cpp
    prerequisite_missing(why)  # outside the except: the failure is not shown chained to the import error
