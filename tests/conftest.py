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
