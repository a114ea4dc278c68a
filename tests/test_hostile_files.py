"""Hostile files (issue 15, item 3): every count and length in a GGUF is checked against a stated
cap before anything is allocated for it, so a file built to make the parser or the loader allocate
many times its size fails with FormatError, never MemoryError or the OOM killer.

The corpus is generated (hostile_gguf.py) and loaded in a child process whose address space is
limited to 1 GiB (RLIMIT_AS, what `ulimit -v 1048576` sets): without the caps, most of these cases
allocate more than that. The child first proves the limit bites (a 1.5 GiB numpy array must raise
MemoryError), then reports one line per case, so a case that kills the child is named.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hostile_gguf import MODEL_KEYS, model_cases, parser_cases
from sharpi.make_model import write_model
from subprocess_env import child_env

LIMIT = 1 << 30

CHILD = r"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (AS_BYTES, AS_BYTES))
import numpy as np
import sharpi
from sharpi import _core
try:
    np.ones(3 << 29, dtype=np.uint8)
    print(json.dumps({"case": "_limit", "error": None}), flush=True)
except MemoryError:
    print(json.dumps({"case": "_limit", "error": "MemoryError"}), flush=True)
loaders = {
    "gguf": lambda p: _core.GgufFile(p),
    "resident": lambda p: sharpi.Session(p, threads=1, n_ctx=32),
    "streamed": lambda p: sharpi.Session(p, threads=1, n_ctx=32, ram_budget="256MiB", reader="pread"),
}
for line in sys.stdin:
    name, loader, path = json.loads(line)
    print(json.dumps({"case": name, "loader": loader, "start": True}), flush=True)
    try:
        loaders[loader](path)
        out = {"error": None}
    except BaseException as e:
        out = {"error": type(e).__name__, "message": str(e)[:400]}
    print(json.dumps({"case": name, "loader": loader, **out}), flush=True)
""".replace("AS_BYTES", str(LIMIT))

PARSER_CASES = [
    "kv_reserve", "tensor_reserve", "nested_arrays", "u8_array", "string_arrays", "long_string",
    "kv_count_2e60", "tensor_count_2e60", "array_count_2e60", "deep_nesting", "five_dims", "zero_dim",
    "dims_overflow", "data_beyond_eof",
]  # fmt: skip
MODEL_CASES = [*MODEL_KEYS, "truncated_data"]
ARCH = "qwen3moe"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    tiny = str(d / "tiny.gguf")
    write_model(tiny, arch=ARCH, preset="tiny", quant="q8_0", seed=1)
    parser = parser_cases(str(d))
    model = model_cases(str(d), tiny, ARCH)
    assert sorted(parser) == sorted(PARSER_CASES) and sorted(model) == sorted(MODEL_CASES)
    jobs = [(n, "gguf", p) for n, p in parser.items()] + [(n, "resident", p) for n, p in parser.items()]
    jobs += [(n, ld, p) for n, p in model.items() for ld in ("resident", "streamed")]
    jobs.append(("_valid", "streamed", tiny))  # the untouched model loads under the same limit
    stdin = "".join(json.dumps(j) + "\n" for j in jobs)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(),
        check=False,  # a dead child is reported per case below
    )
    out: dict = {}
    last = None
    for line in proc.stdout.splitlines():
        r = json.loads(line)
        if r.pop("start", False):
            last = (r["case"], r["loader"])
        else:
            out[(r["case"], r.get("loader"))] = r
    out["_child"] = (proc.returncode, last, proc.stderr[-2000:])
    return out


def _check(results, case, loader):
    r = results.get((case, loader))
    if r is None:
        rc, last, err = results["_child"]
        pytest.fail(f"child died (status {rc}) while loading {last}; no result for {case}/{loader}\n{err}")
    assert r["error"] == "FormatError", f"{case} via {loader}: {r}"
    return r["message"]


def test_the_address_space_limit_bites(results):
    assert results[("_limit", None)]["error"] == "MemoryError"
    assert results[("_valid", "streamed")]["error"] is None, results[("_valid", "streamed")]


@pytest.mark.parametrize("loader", ["gguf", "resident"])
@pytest.mark.parametrize("case", PARSER_CASES)
def test_hostile_header_is_a_format_error(results, case, loader):
    message = _check(results, case, loader)
    assert f"{case}.gguf" in message


@pytest.mark.parametrize("loader", ["resident", "streamed"])
@pytest.mark.parametrize("case", MODEL_CASES)
def test_absurd_hyper_parameter_is_a_format_error(results, case, loader):
    message = _check(results, case, loader)
    if case in MODEL_KEYS:
        key = MODEL_KEYS[case][0]
        assert key in message or "overflow" in message, message
