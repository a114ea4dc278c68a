"""Every input the fuzzer (tests/fuzz/fuzz_gguf.py) ever found a problem with is kept in
tests/fuzz/crashes/ and replayed here through the same loader, in a child process (a crash must
fail this test, not kill the suite): each must now end in a typed sharpi error or load cleanly.
The seed corpus is replayed too, so the harness itself is known to work on valid files.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from subprocess_env import child_env

FUZZ = Path(__file__).resolve().parent / "fuzz"
CRASHES = sorted(p for p in (FUZZ / "crashes").iterdir() if p.is_file() and p.name != "README.md")
SEEDS = sorted((FUZZ / "corpus").iterdir())

REPLAY = r"""
import sys
sys.path.insert(0, sys.argv[1])
from fuzz_gguf_load import load
import sharpi
for path in sys.argv[2:]:
    try:
        load(path)
        print("ok", path, flush=True)
    except sharpi.SharpiError as e:
        print(type(e).__name__, path, flush=True)
"""


def _replay(paths):
    proc = subprocess.run([sys.executable, "-c", REPLAY, str(FUZZ), *map(str, paths)], capture_output=True,
                          text=True, timeout=300, env=child_env(), check=False)  # fmt: skip
    assert proc.returncode == 0, f"replay died ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return dict(reversed(line.split(" ", 1)) for line in proc.stdout.splitlines())


def test_seed_corpus_loads():
    results = _replay(SEEDS)
    assert len(results) == len(SEEDS)
    valid = [p for p in SEEDS if p.name != "header-only.gguf"]
    assert all(results[str(p)] == "ok" for p in valid), results


@pytest.mark.skipif(not CRASHES, reason="the fuzzer has found nothing yet (tests/fuzz/crashes/ is empty)")
def test_every_fuzzer_finding_is_now_a_typed_error():
    results = _replay(CRASHES)
    assert len(results) == len(CRASHES), results
