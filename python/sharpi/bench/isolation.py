"""Isolation of the benchmark's runs: each configuration in its own subprocess, under its own memory
cap, from a cold page cache.

What it owns: launching one worker (`python -m sharpi.bench --worker CONFIG RESULT`, a JSON config
in, a JSON result out) so one run's memory, page cache and cache state never leak into the next;
the cgroup-v1 memory cap around that worker (MemoryCap); and dropping the page cache of the model
file before a run. It never interprets a result: the parent (bench.runner) does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30


def drop_page_cache(paths, how: str = "all") -> str:
    """Empties the page cache of `paths` (the model file: the only file a run reads); returns how.
    how="all": the whole page cache through /proc/sys/vm/drop_caches (root), falling back to
    "fadvise": POSIX_FADV_DONTNEED on each file (what how="file" does directly, sparing the page
    cache of other work on the machine)."""
    if how == "all":
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            return "drop_caches"
        except OSError:
            pass
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


class MemoryCap:
    """A cgroup-v1 memory limit around one benchmark subprocess.

    Owns one child group of this process's own memory cgroup (<own>/sharpi-bench-<pid>-<n>): created
    on enter with memory.limit_in_bytes = limit, removed on exit after its counters are read. Only the
    subprocess launched through command() joins it (a shell writes its own pid to cgroup.procs, then
    execs the worker). It never changes any other group's settings or moves any other process. When
    the controller is absent, read-only or we are not root, the run goes on uncapped and report()
    says why.
    """

    ROOT = Path("/sys/fs/cgroup/memory")
    _count = 0

    def __init__(self, limit_bytes: int, enabled: bool = True):
        self.limit_bytes = int(limit_bytes)
        self.enabled = enabled
        self.group: Path | None = None
        self.applied = False
        self.reason = "disabled (--no-cap)" if not enabled else ""
        self.counters: dict = {}

    def __enter__(self):
        if not self.enabled:
            return self
        if os.geteuid() != 0:
            self.reason = "not root"
            return self
        if not (self.ROOT / "memory.limit_in_bytes").exists():
            self.reason = f"no cgroup-v1 memory controller at {self.ROOT}"
            return self
        own = _own_memory_cgroup()
        MemoryCap._count += 1
        group = self.ROOT / own.lstrip("/") / f"sharpi-bench-{os.getpid()}-{MemoryCap._count}"
        try:
            group.mkdir()
        except OSError as e:
            self.reason = f"cannot create {group}: {e.strerror}"
            return self
        self.group = group
        try:
            (group / "memory.limit_in_bytes").write_text(str(self.limit_bytes))
            memsw = group / "memory.memsw.limit_in_bytes"
            if memsw.exists():  # with swap, cap RAM + swap too, so the budget cannot spill into swap
                try:
                    memsw.write_text(str(self.limit_bytes))
                except OSError:
                    pass
            applied = int((group / "memory.limit_in_bytes").read_text())
        except OSError as e:
            self.reason = f"cannot set the limit in {group}: {e.strerror}"
            self._remove()
            return self
        if applied > self.limit_bytes + 4096:
            self.reason = f"the kernel kept a limit of {applied} bytes"
            self._remove()
            return self
        self.limit_bytes = applied  # rounded down to whole pages by the kernel
        self.applied = True
        return self

    def command(self, argv: list) -> list:
        if not self.applied:
            return argv
        procs = str(self.group / "cgroup.procs")
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', procs, *argv]

    def read_counters(self) -> None:
        if not self.applied or self.group is None:
            return
        g = self.group
        try:
            self.counters["peak_bytes"] = int((g / "memory.max_usage_in_bytes").read_text())
            self.counters["failcnt"] = int((g / "memory.failcnt").read_text())
            oom = dict(
                line.split() for line in (g / "memory.oom_control").read_text().splitlines() if line.strip()
            )
            self.counters["oom_kills"] = int(oom.get("oom_kill", 0))
        except (OSError, ValueError):
            pass

    def report(self) -> dict:
        out = {
            "applied": self.applied,
            "limit_bytes": self.limit_bytes if self.applied else None,
            "reason": None if self.applied else self.reason,
            "group": str(self.group) if self.group else None,
        }
        out.update(self.counters)
        return out

    def _remove(self) -> None:
        if self.group is None:
            return
        for _ in range(50):  # the exiting task may take a moment to leave the group
            try:
                self.group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
        self.group = None

    def __exit__(self, *exc) -> None:
        group = self.group
        self._remove()
        self.group = group  # the report names the group; the directory itself is gone


def _own_memory_cgroup() -> str:
    with open("/proc/self/cgroup") as f:
        for line in f:
            parts = line.rstrip("\n").split(":", 2)
            if len(parts) == 3 and "memory" in parts[1].split(","):
                return parts[2]
    return "/"


def _child_env() -> dict:
    # The child must import this very sharpi (a developer build under python/ included):
    # <root>/sharpi/bench/isolation.py.
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def launch(cfg: dict, work: Path, label: str, cap: MemoryCap | None = None) -> dict:
    """Runs one worker; returns its result dict (ok False with the reason if it failed or was killed)."""
    work.mkdir(parents=True, exist_ok=True)
    cfg_path, res_path = work / f"{label}.config.json", work / f"{label}.result.json"
    cfg_path.write_text(json.dumps(cfg))
    res_path.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "sharpi.bench", "--worker", str(cfg_path), str(res_path)]
    if cap is not None:
        argv = cap.command(argv)
    proc = subprocess.run(
        argv, check=False, env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    if cap is not None:
        cap.read_counters()
    if res_path.is_file():
        result = json.loads(res_path.read_text())
    else:
        killed = proc.returncode in (-9, 137)
        oom = cap is not None and cap.counters.get("oom_kills", 0) > 0
        why = (
            "killed by the OOM killer under the memory cap"
            if killed and oom
            else f"exit status {proc.returncode}"
        )
        result = {"ok": False, "error": f"worker {label}: {why}; output: {proc.stdout[-2000:].strip()}"}
    return result
