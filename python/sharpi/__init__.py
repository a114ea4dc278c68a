"""sharpi: run Mixture-of-Experts LLMs from GGUF files with experts streamed from fast memory tiers.

The engine is C++ (sharpi._core); this package adds the tokenizer, generation loop and CLI.
"""

import os as _os

from ._core import (  # noqa: F401
    CancelledError,
    ContextOverflowError,
    DeviceError,
    FormatError,
    InvalidArgument,
    IoError,
    MissingTensorError,
    SharpiError,
    UnsupportedError,
    cuda_available,
    cuda_describe,
)
from .plugin import Predictor  # noqa: F401
from .session import Session  # noqa: F401

__version__ = "0.1.0"


def cache_policies() -> list:
    """Names of the expert cache's replacement policies (Session(cache_policy=...))."""
    from ._core import replacement_policy_names

    return list(replacement_policy_names())


def default_cache_policy() -> str:
    """The policy a streaming session uses unless told otherwise (docs/cache_policies.md)."""
    from ._core import default_replacement_policy

    return default_replacement_policy()


def cmake_prefix() -> str:
    """A CMAKE_PREFIX_PATH entry for find_package(sharpi) against this installation."""
    return _os.path.dirname(_os.path.abspath(__file__))
