"""What the fuzzer does with one input (fuzz_gguf.py), importable without atheris so that
test_fuzz_regressions.py replays findings the same way."""

from __future__ import annotations

import sharpi
from sharpi import _core


def load(path: str) -> None:
    """Opens `path` the ways a user does: GgufFile (every key and tensor read back), then a resident
    Session and, when that loads, a streamed one, each decoding one token. Raises only
    sharpi.SharpiError for a bad file."""
    f = _core.GgufFile(path)
    f.metadata()
    f.metadata_types()
    for t in f.tensors():
        f.tensor_bytes(t["name"])
    del f
    try:
        s = sharpi.Session(path, threads=1, n_ctx=16)
    except sharpi.SharpiError:
        return
    s.decode([0])
    del s
    s = sharpi.Session(path, threads=1, n_ctx=16, ram_budget="64MiB", reader="pread")
    s.decode([0])
