"""`--ram-budget auto`: the memory this process may still take, from the kernel's own accounting.

available = min(MemAvailable of /proc/meminfo, and for every memory cgroup this process is in,
from its own group up to the root: limit - usage), where cgroup v2 reads memory.max / memory.current
and v1 memory.limit_in_bytes / memory.usage_in_bytes ("max" or a v1 limit near 2^63 = no limit).
The budget is available minus a margin of max(256 MiB, 10 % of available): the Python
interpreter, libraries and allocator slack sit outside the budget (docs/design.md §2 charges only what
sharpi allocates), and the page cache of a streamed file needs some room to stay useful.

Reads files only; paths are parameters so tests can point them at a fake cgroup tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MIB = 1 << 20
MARGIN_MIN = 256 * MIB
MARGIN_FRACTION = 0.10
_NO_LIMIT = 1 << 62  # v1 reports "unlimited" as a page-rounded 2^63 - 1


@dataclass
class AutoBudget:
    budget: int  # bytes: available - margin
    available: int
    margin: int
    source: str  # what bounded `available`, e.g. "cgroup v1 /x: limit 1024.0 MiB - usage 10.2 MiB"

    def describe(self) -> str:
        return (
            f"--ram-budget auto: {self.budget / MIB:.1f} MiB = {self.available / MIB:.1f} MiB available "
            f"({self.source}) - margin {self.margin / MIB:.1f} MiB"
        )


def _read_int(path: str):
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text in ("", "max"):
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value < _NO_LIMIT else None


def mem_available(meminfo: str = "/proc/meminfo"):
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_dirs(proc_cgroup: str, cgroup_root: str):
    """(version, directory of this process's memory cgroup) pairs found in proc_cgroup."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if "memory" in controllers.split(","):
            found.append(("v1", os.path.join(cgroup_root, "memory"), path))
        elif controllers == "" and parts[0] == "0":
            base = os.path.join(cgroup_root, "unified")
            found.append(("v2", base if os.path.isdir(base) else cgroup_root, path))
    out = []
    for version, mount, path in found:
        here = os.path.join(mount, path.lstrip("/"))
        if not os.path.isdir(here):  # a container that sees its own group as the mount root
            here = mount
        out.append((version, mount, here))
    return out


def cgroup_available(proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup"):
    """(bytes, description) of the tightest limit - usage over this process's memory cgroups and
    their ancestors, or None when no group sets a limit."""
    best = None
    for version, mount, here in _cgroup_dirs(proc_cgroup, cgroup_root):
        names = ("memory.max", "memory.current") if version == "v2" else (
            "memory.limit_in_bytes", "memory.usage_in_bytes")
        d = here
        while True:
            limit = _read_int(os.path.join(d, names[0]))
            if limit is not None:
                usage = _read_int(os.path.join(d, names[1])) or 0
                left = max(0, limit - usage)
                if best is None or left < best[0]:
                    rel = "/" if os.path.samefile(d, mount) else "/" + os.path.relpath(d, mount)
                    best = (left, f"cgroup {version} {rel}: limit {limit / MIB:.1f} MiB - usage {usage / MIB:.1f} MiB")
            if os.path.normpath(d) == os.path.normpath(mount):
                break
            d = os.path.dirname(d)
    return best


def auto_ram_budget(
    proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup", meminfo: str = "/proc/meminfo"
) -> AutoBudget:
    from . import _core

    candidates = []
    avail = mem_available(meminfo)
    if avail is not None:
        candidates.append((avail, "MemAvailable"))
    cg = cgroup_available(proc_cgroup, cgroup_root)
    if cg is not None:
        candidates.append(cg)
    if not candidates:
        raise _core.InvalidArgument("--ram-budget auto: found neither /proc/meminfo nor a cgroup memory limit")
    available, source = min(candidates)
    margin = max(MARGIN_MIN, int(available * MARGIN_FRACTION))
    if available <= margin:
        raise _core.InvalidArgument(
            f"--ram-budget auto: only {available / MIB:.1f} MiB available ({source}), less than the "
            f"{margin / MIB:.0f} MiB margin"
        )
    return AutoBudget(available - margin, available, margin, source)
