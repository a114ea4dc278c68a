"""`--ram-budget auto`: the memory this process may still take, minus a margin.

The probe and the arithmetic are C++ (cpp/src/ram_budget.h; the session's planner resolves
ram_budget="auto" itself, cpp/src/placement.h): available = min(MemAvailable, and limit - usage of
every memory cgroup of this process up to the root, v1 and v2), budget = available - max(256 MiB,
10 % of available). This module names the result for Python callers (`sharpi inspect --plan`, tests
that point the probe at a fake cgroup tree) through sharpi._internal.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import _internal

MIB = 1 << 20
MARGIN_MIN = _internal.RAM_BUDGET_MARGIN_MIN
MARGIN_FRACTION = _internal.RAM_BUDGET_MARGIN_FRACTION


@dataclass
class AutoBudget:
    budget: int  # bytes: available - margin
    available: int
    margin: int
    source: str  # what bounded `available`, e.g. "cgroup v1 /x: limit 1024.0 MiB - usage 10.2 MiB"
    summary: str  # the C++ AutoRamBudget::describe()

    @classmethod
    def from_dict(cls, d: dict) -> AutoBudget:
        return cls(d["budget"], d["available"], d["margin"], d["source"], d["summary"])

    def describe(self) -> str:
        return self.summary


def cgroup_available(proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup"):
    """(bytes, description) of the tightest limit - usage over this process's memory cgroups and
    their ancestors, or None when no group sets a limit."""
    return _internal.ram_cgroup_available(proc_cgroup, cgroup_root)


def auto_ram_budget(
    proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup", meminfo: str = "/proc/meminfo"
) -> AutoBudget:
    """The budget `auto` stands for (InvalidArgument when nothing is readable or left above the margin)."""
    return AutoBudget.from_dict(_internal.ram_budget_auto(proc_cgroup, cgroup_root, meminfo))
