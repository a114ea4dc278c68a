"""The C++ example host builds against the installed CMake package (find_package(sharpi)) and, using
the public C++ API alone, generates the same greedy tokens as the Python API."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import numpy as np
import pytest
import sharpi
from sharpi.make_model import write_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cpp_host_via_find_package(tmp_path):
    if shutil.which("cmake") is None:
        pytest.skip("cmake not installed")
    prefix = sharpi.cmake_prefix()
    if not os.path.exists(os.path.join(prefix, "lib", "cmake", "sharpi", "sharpiConfig.cmake")):
        pytest.skip("sharpi is not pip-installed here (developer build has no CMake package)")
    model = str(tmp_path / "tiny.gguf")
    write_model(model, arch="qwen2moe", preset="tiny", quant="q4_k_m", seed=3)
    build = tmp_path / "build"
    subprocess.run(["cmake", "-S", os.path.join(ROOT, "examples", "cpp_host"), "-B", str(build),
                    f"-DCMAKE_PREFIX_PATH={prefix}", f"-DSHARPI_TEST_MODEL={model}"], check=True)
    subprocess.run(["cmake", "--build", str(build), "-j2"], check=True)
    subprocess.run(["ctest", "--test-dir", str(build), "--output-on-failure"], check=True)

    out = subprocess.run([str(build / "sharpi_host"), model, "5,6,7", "8"], check=True, capture_output=True,
                         text=True).stdout
    host_tokens = [int(t) for t in re.search(r"generated:((?: \d+)+)", out).group(1).split()]

    s = sharpi.Session(model, threads=2)
    logits = s.decode([5, 6, 7])
    expected = []
    for _ in range(8):
        expected.append(int(np.argmax(logits)))
        logits = s.decode([expected[-1]])
    assert host_tokens == expected
    # The same prompt on two sequences in one decode_batch step each: the same ids, both.
    for b in (0, 1):
        batched = [int(t) for t in re.search(rf"batched sequence {b}:((?: \d+)+)", out).group(1).split()]
        assert batched == expected, f"sequence {b}"

    # Streamed, with the host's own C++ predictor (sharpi/predictor.h): same tokens, and its hints
    # were called for every layer of every decoded token and turned into reads.
    st = sharpi.Session(model, ram_budget="1GiB", n_seq=2).expert_stats()  # the host's n_ctx and n_seq
    budget = st["fixed_bytes"] + (2 + 2) * st["slot_bytes"]  # top-2 cache slots + top-2 staging
    done = subprocess.run([str(build / "sharpi_host"), model, "5,6,7", "8", str(budget)], check=False,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    streamed_tokens = [int(t) for t in re.search(r"generated:((?: \d+)+)", done.stdout).group(1).split()]
    assert streamed_tokens == expected
    calls, issued, used = map(int, re.search(r"predictor calls (\d+), prefetch issued (\d+), used (\d+)",
                                             done.stdout).groups())
    assert calls == 8 * s.info["n_layer"] and issued > 0 and used <= issued
