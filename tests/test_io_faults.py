"""IO faults at the system-call boundary (issue 15, item 4): the readers' real error branches run.

- pread reader: an LD_PRELOAD shim (faults/pread_shim.c, compiled here with cc) makes pread/preadv
  on the model file fail with EIO, EAGAIN, EINTR or come back short at a chosen offset mid-file.
- io_uring reader: completions come from a shared ring with no call to intercept, so the reader's
  test hook SHARPI_FAULT_URING_RES rewrites a completion's `res` after the kernel has done the read
  (EIO, -EAGAIN, -ECANCELED, -EINTR, short counts, -EOPNOTSUPP on a registered-buffer read).

Each case runs a streamed session in a child process, at the minimum budget (k slots: every miss
evicts) and with every expert cached, on a prompt whose first layer is known (from the resident
engine's dump) to read the faulted expert. Transient faults must give exactly the resident logits;
hard ones a typed IoError naming the file and tensor, after which reset() leaves a session that
decodes the resident logits again. The shim's log (or the hook's absence of effect) is checked so a
fault that never fired fails the test instead of passing it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sharpi
from reader_policy import uring_unavailable
from reference.engine_checks import greedy_logits
from sharpi import _core
from sharpi.make_model import write_model
from subprocess_env import child_env

TESTS = Path(__file__).resolve().parent
PROMPT = [5, 17, 33, 2, 9, 41, 7]
N_DECODE = 6

CHILD = r"""
import json, sys
import numpy as np
import sharpi
from reference.engine_checks import greedy_logits
path, budget, reader, out_dir, prompt, n_decode = sys.argv[1:7]
prompt = json.loads(prompt)
s = sharpi.Session(path, threads=2, n_ctx=128, ram_budget=int(budget), reader=reader)
report = {"reader": s.expert_stats()["reader"]}
try:
    np.save(out_dir + "/first.npy", greedy_logits(s, prompt, int(n_decode)))
    report["first"] = "ok"
except sharpi.IoError as e:
    report["first"] = "IoError"
    report["message"] = str(e)
s.reset()
try:
    np.save(out_dir + "/after_reset.npy", greedy_logits(s, prompt, int(n_decode)))
    report["after_reset"] = "ok"
except sharpi.IoError as e:
    report["after_reset"] = "IoError: " + str(e)
report["detail"] = s.expert_stats()["reader_detail"]
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("io_faults")
    path = str(d / "faulted.gguf")
    write_model(path, arch="qwen2moe", preset="tiny", quant="q4_k_m", seed=11)
    resident = greedy_logits(sharpi.Session(path, threads=2, n_ctx=128), PROMPT, N_DECODE)
    # An expert layer 0 selects for the prompt's first token: its read is among the first misses.
    probe = sharpi.Session(path, threads=1, n_ctx=128, dump_activations=True)
    probe.decode(PROMPT[:1])
    expert = int(probe.dump()["ffn_moe_topk-0"].astype(int).ravel()[0])
    offset, length = _core.GgufFile(path).expert_range("blk.0.ffn_up_exps.weight", expert)
    s = sharpi.Session(path, threads=1, n_ctx=128, ram_budget="4GiB", reader="pread")
    st, info = s.expert_stats(), s.info
    k, total = info["n_expert_used"], info["n_layer"] * info["n_expert"]
    budgets = {"min": st["fixed_bytes"] + k * st["slot_bytes"], "all": st["fixed_bytes"] + total * st["slot_bytes"]}
    # Mid-range and not 4 KiB-aligned: a short read stops at an unaligned position.
    return {
        "path": path,
        "resident": resident,
        "offset": int(offset) + int(length) // 2 + 100,
        "expert_begin": int(offset),
        "budgets": budgets,
    }


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is needed to build the pread fault shim (the package build needs one too)"
    out = str(tmp_path_factory.mktemp("shim") / "pread_shim.so")
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", out, str(TESTS / "faults" / "pread_shim.c"), "-ldl",
                    "-lpthread"], check=True)  # fmt: skip
    return out


def _require_uring(path: str) -> None:
    """Fails (on Linux; reader_policy.py) when the io_uring reader cannot stream `path` here."""
    try:
        sharpi.Session(path, threads=1, n_ctx=64, ram_budget="1GiB", reader="uring")
    except (sharpi.UnsupportedError, sharpi.IoError) as e:
        uring_unavailable(str(e))


def _run(model, tmp_path, reader, budget, env_extra):
    env = child_env(str(TESTS), base={**os.environ, **env_extra})
    cmd = [sys.executable, "-c", CHILD, model["path"], str(model["budgets"][budget]), reader, str(tmp_path),
           json.dumps(PROMPT), str(N_DECODE)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, f"child died ({proc.returncode}): {proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _expect(model, tmp_path, report, hard: bool):
    resident = model["resident"]
    if hard:
        assert report["first"] == "IoError", report
        msg = report["message"]
        assert model["path"] in msg and "blk.0.ffn_up_exps.weight" in msg, msg
    else:
        assert report["first"] == "ok", report
        np.testing.assert_array_equal(np.load(tmp_path / "first.npy"), resident)
    assert report["after_reset"] == "ok", report
    np.testing.assert_array_equal(np.load(tmp_path / "after_reset.npy"), resident)


# (fault spec without the offset, whether it must surface as IoError). 9 EAGAINs in a row exceed the
# readers' 8 retries; the rest are retried or resumed.
PREAD_FAULTS = [("EIO", True), ("EAGAIN x3", False), ("EAGAIN x9", True), ("EINTR x3", False), ("short x4", False)]
URING_FAULTS = [*PREAD_FAULTS, ("ECANCELED x2", False), ("ECANCELED x9", True)]
BUDGETS = ["min", "all"]


def _spec(fault: str, offset: int) -> str:
    what, _, count = fault.partition(" ")
    return f"{what}@{offset}" + (count if count else "")


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("fault,hard", PREAD_FAULTS)
def test_pread_syscall_faults(model, shim, tmp_path, fault, hard, budget):
    log = tmp_path / "shim.log"
    env = {
        "LD_PRELOAD": " ".join(p for p in (os.environ.get("LD_PRELOAD"), shim) if p),
        "SHARPI_SHIM_PATH": os.path.basename(model["path"]),
        "SHARPI_SHIM_FAULT": _spec(fault, model["offset"]),
        "SHARPI_SHIM_LOG": str(log),
        "SHARPI_SHIM_FROM": str(model["expert_begin"] // 4096 * 4096),
    }
    report = _run(model, tmp_path, "pread", budget, env)
    assert report["reader"] == "pread", report
    injected = log.read_text().splitlines() if log.exists() else []
    want = int(fault.split("x")[1]) if "x" in fault else 1
    # A short read moves past the offset, so later reads of the same bytes may not cover it again.
    fired_ok = 1 <= len(injected) <= want if fault.startswith("short") else len(injected) == want
    assert fired_ok, f"the shim fired {len(injected)} times, expected {want}: {injected}"
    _expect(model, tmp_path, report, hard)


@pytest.mark.concurrency
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("fault,hard", URING_FAULTS)
def test_uring_completion_faults(model, tmp_path, fault, hard, budget):
    _require_uring(model["path"])
    report = _run(model, tmp_path, "uring", budget, {"SHARPI_FAULT_URING_RES": _spec(fault, model["offset"])})
    assert report["reader"] == "io_uring", report
    want = int(fault.split("x")[1]) if "x" in fault else 1
    fired = re.search(r"(\d+) completions rewritten", report["detail"])
    assert fired, f"the hook never fired: {report['detail']}"
    assert 1 <= int(fired.group(1)) <= want if fault.startswith("short") else int(fired.group(1)) == want
    _expect(model, tmp_path, report, hard)


def test_uring_registered_buffer_refusal_falls_back_to_plain_reads(model, tmp_path):
    """A READ_FIXED completing with -EOPNOTSUPP (a file that takes no fixed buffers) switches the
    reader to plain reads, that chunk included: same logits, and describe() says why. Where the
    arena could not be registered at all (RLIMIT_MEMLOCK) the read was a plain one, and the same
    error is then a hard one."""
    _require_uring(model["path"])
    report = _run(model, tmp_path, "uring", "min", {"SHARPI_FAULT_URING_RES": f"EOPNOTSUPP@{model['offset']}"})
    assert "1 completions rewritten" in report["detail"], report
    if "registration failed" in report["detail"]:
        _expect(model, tmp_path, report, hard=True)
    else:
        assert "READ_FIXED refused: Operation not supported" in report["detail"], report
        _expect(model, tmp_path, report, hard=False)


@pytest.mark.parametrize("value", ["EIO", "EIO@", "bogus@12", "EIO@12x0", "EIO@-1"])
def test_uring_fault_hook_rejects_bad_specs(model, monkeypatch, value):
    monkeypatch.setenv("SHARPI_FAULT_URING_RES", value)
    with pytest.raises(sharpi.InvalidArgument, match="SHARPI_FAULT_URING_RES"):
        sharpi.Session(model["path"], threads=1, n_ctx=64, ram_budget="1GiB", reader="uring")


TRUNCATE_CHILD = r"""
import json, os, sys
import sharpi
from sharpi import _core
path, where = sys.argv[1:3]
s = sharpi.Session(path, threads=2, n_ctx=64)
s.decode([1, 2, 3])
f = _core.GgufFile(path)
experts = [t["file_offset"] for t in f.tensors() if "_exps." in t["name"]]
cut = min(experts) + 10 if where == "experts" else f.data_offset + 10
del f
os.truncate(path, cut)
report = {"cut": cut}
for attempt in ("first", "after_reset"):
    try:
        s.decode(list(range(4, 12)))
        report[attempt] = "ok"
    except sharpi.IoError as e:
        report[attempt] = "IoError: " + str(e)
    s.reset()
print(json.dumps(report))
"""


@pytest.mark.parametrize("where", ["experts", "dense"])
def test_resident_survives_truncation_after_open(model, tmp_path, where):
    """Resident mode computes from a MAP_SHARED mapping: truncating the file under it makes the next
    access a SIGBUS. map_guard.h turns that into an IoError from decode() (the pages read as zeros
    and the result is discarded), every later decode raises it too, and the process lives."""
    path = str(tmp_path / "victim.gguf")
    shutil.copy(model["path"], path)
    proc = subprocess.run([sys.executable, "-c", TRUNCATE_CHILD, path, where], capture_output=True, text=True,
                          timeout=120, env=child_env(), check=False)  # fmt: skip
    assert proc.returncode == 0, f"child died ({proc.returncode}): {proc.stderr[-3000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for attempt in ("first", "after_reset"):
        assert report[attempt].startswith("IoError"), report
        assert "victim.gguf" in report[attempt] and "truncated or changed after it was opened" in report[attempt]
