"""sharpi: run Mixture-of-Experts LLMs from GGUF files with experts streamed from fast memory tiers.

The engine is C++ (sharpi._core: its public API; sharpi._internal: the internals the package's
planners, the tests and the benchmarks use); this package adds the tokenizer, generation loop and CLI.
"""

import os as _os


def _point_at_the_cufile_wheel() -> None:
    """The cuFile reader loads libcufile with dlopen ($SHARPI_CUFILE_LIB, else the loader's search
    path). pip's nvidia-cufile wheel puts it under site-packages/nvidia/*/lib, which the loader does
    not search: name it, unless the user did."""
    if _os.environ.get("SHARPI_CUFILE_LIB"):
        return
    try:
        import nvidia  # namespace package of NVIDIA's wheels
    except ImportError:
        return
    for base in getattr(nvidia, "__path__", []):
        for sub in ("cu13", "cu12", "cufile"):
            lib = _os.path.join(base, sub, "lib", "libcufile.so.0")
            if _os.path.isfile(lib):
                _os.environ["SHARPI_CUFILE_LIB"] = lib
                return


_point_at_the_cufile_wheel()

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
)
from ._internal import cuda_available, cuda_describe  # noqa: F401
from .plugin import Predictor  # noqa: F401
from .session import Sequence, Session  # noqa: F401

__version__ = "0.1.0"


def cache_policies() -> list:
    """Names of the expert cache's replacement policies (Session(cache_policy=...))."""
    from ._internal import replacement_policy_names

    return list(replacement_policy_names())


def default_cache_policy() -> str:
    """The policy a streaming session uses unless told otherwise (docs/cache_policies.md)."""
    from ._internal import default_replacement_policy

    return default_replacement_policy()


def cmake_prefix() -> str:
    """A CMAKE_PREFIX_PATH entry for find_package(sharpi) against this installation."""
    return _os.path.dirname(_os.path.abspath(__file__))
