"""Coverage-guided fuzzing of the GGUF reader and model loading with atheris (issue 15, item 5).

    python tests/fuzz/fuzz_gguf.py tests/fuzz/corpus -max_total_time=60 -rss_limit_mb=2048

Each input is written to a file and opened the ways a user opens one (fuzz_gguf_load.py):
_core.GgufFile (every key and tensor read back), then sharpi.Session (model loading: hyper-
parameters, tensor shapes, tokenizer) resident and, when that loads, streamed, one decode step each. A typed sharpi error is
the correct answer to a bad file; anything else (another Python exception, a crash, a sanitizer
report, an allocation past -rss_limit_mb) is a finding. libFuzzer writes each finding as
crash-<sha1> into the working directory: copy it into tests/fuzz/crashes/, where test_fuzz_regressions.py
replays every file on every test run.

Coverage: atheris instruments the Python it imports; the C++ core is instrumented only when built
with clang's -fsanitize=fuzzer-no-link (not the case with gcc: the mutations are then guided by the
Python side and the seed corpus, tests/fuzz/corpus, written by make_seeds.py).
"""

from __future__ import annotations

import os
import sys
import tempfile

import atheris
import numpy  # noqa: F401  (imported first so that only sharpi's own Python is instrumented)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
with atheris.instrument_imports():
    import sharpi
    from fuzz_gguf_load import load

_DIR = tempfile.mkdtemp(prefix="sharpi-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
_PATH = os.path.join(_DIR, "input.gguf")


def TestOneInput(data: bytes) -> None:
    with open(_PATH, "wb") as out:
        out.write(data)
    try:
        load(_PATH)
    except sharpi.SharpiError:
        pass


if __name__ == "__main__":
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()
