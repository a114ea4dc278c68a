"""Memory as promised: the process's peak (VmHWM) over a 2,000-token run stays within its RAM budget
plus what a bare `import sharpi` costs plus 64 MiB, for every KV cache type; and `--ram-budget auto`
picks a budget under the memory cgroup's limit (a real cgroup v1 child group where this runs as
root with a writable memory controller; fake cgroup trees for the parsing of v1 and v2).
"""

import json
import os
import subprocess
import sys

import pytest
import sharpi
from sharpi import _internal
from sharpi.make_model import write_model
from sharpi.ram_budget import MARGIN_MIN, auto_ram_budget, cgroup_available
from subprocess_env import child_env

MIB = 1 << 20
N_CTX = 2048
N_PROMPT = 1800
N_DECODE = 200

HWM = "def hwm():\n    return int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) * 1024\n"

RUN_SCRIPT = HWM + """
import json, sys
import sharpi
path, budget, kv = sys.argv[1], int(sys.argv[2]), sys.argv[3]
s = sharpi.Session(path, threads=2, n_ctx=N_CTX, ram_budget=budget, cache_type_k=kv, cache_type_v=kv)
prompt = [(i * 7919) % 4000 + 1 for i in range(N_PROMPT)]
token = int(s.decode(prompt).argmax())
for _ in range(N_DECODE):
    token = int(s.decode([token]).argmax())
st = s.expert_stats()
print(json.dumps({"peak": hwm(), "n_past": s.n_past, "misses": sum(l["misses"] for l in st["layers"]),
                  "n_slots": st["n_slots"], "bytes_kv": s.info["bytes_kv"]}))
""".replace("N_CTX", str(N_CTX)).replace("N_PROMPT", str(N_PROMPT)).replace("N_DECODE", str(N_DECODE))

BARE_SCRIPT = HWM + "import sharpi\nprint(hwm())\n"


@pytest.fixture(scope="module")
def streamed_model(tmp_path_factory):
    # 4 layers x 16 experts of width 512 at q4_k, vocabulary 4096: the budget below holds a quarter
    # of the experts, so the run reads experts all along.
    path = str(tmp_path_factory.mktemp("mem") / "mem.gguf")
    write_model(path, preset="tiny", quant="q4_k", seed=2, n_layer=4, n_expert=16, n_embd=512, n_ff_exp=512,
                vocab_size=4096)
    return path


@pytest.mark.parametrize("kv", ["f32", "f16", "q8_0"])
def test_peak_memory_within_budget(streamed_model, kv):
    plan = _internal.memory_plan(streamed_model, n_ctx=N_CTX, cache_type_k=kv, cache_type_v=kv)
    total = 4 * 16
    budget = plan["fixed_bytes"] + (total // 4) * plan["slot_bytes"]
    env = child_env()
    bare = int(subprocess.run([sys.executable, "-c", BARE_SCRIPT], check=True, capture_output=True, text=True,
                              env=env).stdout.strip())
    out = subprocess.run([sys.executable, "-c", RUN_SCRIPT, streamed_model, str(budget), kv], check=True,
                         capture_output=True, text=True, env=env).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["n_past"] == N_PROMPT + N_DECODE
    assert r["n_slots"] == total // 4 and r["misses"] > 100, r
    assert r["bytes_kv"] == plan["kv_bytes"]
    bound = budget + bare + 64 * MIB
    assert r["peak"] <= bound, (
        f"{kv}: VmHWM {r['peak'] / MIB:.1f} MiB > budget {budget / MIB:.1f} + bare import {bare / MIB:.1f} + 64 MiB"
    )


# ---- --ram-budget auto ----------------------------------------------------------------------------


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_auto_budget_reads_fake_v1_and_v2_trees(tmp_path):
    meminfo = tmp_path / "meminfo"
    _write(str(meminfo), "MemTotal: 16000000 kB\nMemAvailable: 8388608 kB\n")  # 8 GiB
    # v1: the limit is on the parent of this process's group; the group itself is unlimited.
    root = tmp_path / "v1"
    _write(str(root / "memory/a/memory.limit_in_bytes"), str(3 * 1024 * MIB))
    _write(str(root / "memory/a/memory.usage_in_bytes"), str(1024 * MIB))
    _write(str(root / "memory/a/b/memory.limit_in_bytes"), "9223372036854771712")
    _write(str(root / "memory/a/b/memory.usage_in_bytes"), str(100 * MIB))
    _write(str(tmp_path / "cg1"), "4:memory:/a/b\n1:cpu:/\n0::/\n")
    b = auto_ram_budget(str(tmp_path / "cg1"), str(root), str(meminfo))
    assert b.available == 2048 * MIB and "cgroup v1 /a" in b.source
    assert b.margin == max(MARGIN_MIN, int(0.1 * 2048 * MIB)) and b.budget == b.available - b.margin
    # v2: memory.max "max" is no limit; MemAvailable bounds it then.
    root2 = tmp_path / "v2"
    _write(str(root2 / "x/memory.max"), "max")
    _write(str(root2 / "x/memory.current"), "0")
    _write(str(tmp_path / "cg2"), "0::/x\n")
    assert cgroup_available(str(tmp_path / "cg2"), str(root2)) is None
    b = auto_ram_budget(str(tmp_path / "cg2"), str(root2), str(meminfo))
    assert b.available == 8 * 1024 * MIB and b.source == "MemAvailable"
    _write(str(root2 / "x/memory.max"), str(1024 * MIB))
    _write(str(root2 / "x/memory.current"), str(24 * MIB))
    b = auto_ram_budget(str(tmp_path / "cg2"), str(root2), str(meminfo))
    assert b.available == 1000 * MIB and b.source.startswith("cgroup v2 /x")
    # Less than the margin available: a clear error.
    _write(str(root2 / "x/memory.current"), str(1000 * MIB))
    with pytest.raises(sharpi.InvalidArgument, match="margin"):
        auto_ram_budget(str(tmp_path / "cg2"), str(root2), str(meminfo))


def test_auto_budget_messages_and_sources(tmp_path):
    # The probe is C++ (cpp/src/ram_budget.h): its texts, read against the numbers the fake tree holds.
    meminfo = tmp_path / "meminfo"
    _write(str(meminfo), "MemTotal: 4000000 kB\nMemAvailable: 1048576 kB\n")  # 1 GiB
    b = auto_ram_budget(str(tmp_path / "none"), str(tmp_path / "none"), str(meminfo))
    assert (b.available, b.margin, b.source) == (1024 * MIB, MARGIN_MIN, "MemAvailable")
    assert b.describe() == "--ram-budget auto: 768.0 MiB = 1024.0 MiB available (MemAvailable) - margin 256.0 MiB"
    # v2 at the mount root ("0::/"): the root group's own limit, named "/".
    root = tmp_path / "v2"
    _write(str(root / "memory.max"), str(512 * MIB))
    _write(str(root / "memory.current"), str(64 * MIB + 512 * 1024))
    _write(str(tmp_path / "cg"), "0::/\n")
    assert cgroup_available(str(tmp_path / "cg"), str(root)) == (
        448 * MIB - 512 * 1024, "cgroup v2 /: limit 512.0 MiB - usage 64.5 MiB")
    # A group the mount does not show (a container's own view): its limits are read at the mount.
    _write(str(tmp_path / "cg_hidden"), "0::/not/here\n")
    assert cgroup_available(str(tmp_path / "cg_hidden"), str(root))[0] == 448 * MIB - 512 * 1024
    with pytest.raises(sharpi.InvalidArgument, match="found neither /proc/meminfo nor a cgroup memory limit"):
        auto_ram_budget(str(tmp_path / "none"), str(tmp_path / "none"), str(tmp_path / "none"))
    _write(str(meminfo), "MemAvailable: 204800 kB\n")  # 200 MiB
    with pytest.raises(sharpi.InvalidArgument) as excinfo:
        auto_ram_budget(str(tmp_path / "none"), str(tmp_path / "none"), str(meminfo))
    assert str(excinfo.value).endswith(
        "--ram-budget auto: only 200.0 MiB available (MemAvailable), less than the 256 MiB margin")


def test_session_resolves_auto_in_the_planner(streamed_model):
    # "auto" in any case reaches the C++ planner as it is: the session reports the choice, and the
    # expert cache was sized from exactly that budget.
    s = sharpi.Session(streamed_model, threads=1, n_ctx=256, ram_budget=" Auto ")
    a = s.auto_budget
    assert a is not None and a.budget == a.available - a.margin
    assert a.margin == max(MARGIN_MIN, int(a.available * 0.1))
    assert s.expert_stats()["budget_bytes"] == a.budget
    assert a.describe().startswith(f"--ram-budget auto: {a.budget / MIB:.1f} MiB = {a.available / MIB:.1f} MiB")
    assert sharpi.Session(streamed_model, threads=1, n_ctx=256, ram_budget=0).auto_budget is None
    with pytest.raises(sharpi.InvalidArgument, match="ram_budget must be bytes >= 0"):
        sharpi.Session(streamed_model, threads=1, n_ctx=256, ram_budget=-1)


def _own_v1_memory_group():
    if os.geteuid() != 0:
        return None
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(","):
                d = os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"))
                return d if os.access(d, os.W_OK) else None
    return None


AUTO_SCRIPT = """
import json, os, sys
with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
import sharpi
s = sharpi.Session(sys.argv[2], threads=1, n_ctx=256, ram_budget="auto")
s.decode([1, 2, 3])
print(json.dumps({"budget": s.auto_budget.budget, "source": s.auto_budget.source,
                  "describe": s.auto_budget.describe(), "planned": s.expert_stats()["budget_bytes"]}))
"""


def test_auto_budget_inside_a_real_cgroup_v1_limit(streamed_model):
    parent = _own_v1_memory_group()
    if parent is None:
        pytest.skip("needs root and a writable cgroup v1 memory controller (the fake-tree test covers parsing)")
    group = os.path.join(parent, f"sharpi-test-{os.getpid()}")
    os.mkdir(group)
    limit = 1024 * MIB
    try:
        _write(os.path.join(group, "memory.limit_in_bytes"), str(limit))
        out = subprocess.run([sys.executable, "-c", AUTO_SCRIPT, group, streamed_model], check=True,
                             capture_output=True, text=True, env=child_env()).stdout
    finally:
        os.rmdir(group)
    r = json.loads(out.strip().splitlines()[-1])
    assert r["source"].startswith("cgroup v1 /") and f"sharpi-test-{os.getpid()}" in r["source"], r
    assert r["planned"] == r["budget"]
    assert limit - 400 * MIB < r["budget"] < limit - MARGIN_MIN, r  # usage: the interpreter so far
