// `ram_budget "auto"` (SessionOptions::kRamBudgetAuto, `--ram-budget auto`): the memory this process
// may still take, from the kernel's own accounting.
//
// available = min(MemAvailable of /proc/meminfo, and for every memory cgroup this process is in, from
// its own group up to the root: limit - usage), where cgroup v2 reads memory.max / memory.current and
// v1 memory.limit_in_bytes / memory.usage_in_bytes ("max" or a v1 limit near 2^63 = no limit). The
// budget is available minus a margin of max(256 MiB, 10 % of available): the host interpreter,
// libraries and allocator slack sit outside the budget (docs/design.md §2 charges only what sharpi
// allocates), and the page cache of a streamed file needs some room to stay useful.
//
// Reads files only; the paths are parameters so tests can point them at a fake cgroup tree. The
// planner (placement.h) resolves "auto" with it before the model is loaded, so what the session
// itself allocates is inside the budget, not subtracted from it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "sharpi/options.h"

namespace sharpi {

constexpr uint64_t kRamBudgetMarginMin = 256ull << 20;
constexpr double kRamBudgetMarginFraction = 0.10;

// Where the probe reads; the defaults are this process's own files.
struct MemoryProbePaths {
    std::string proc_cgroup = "/proc/self/cgroup";
    std::string cgroup_root = "/sys/fs/cgroup";
    std::string meminfo = "/proc/meminfo";
};

// MemAvailable in bytes, or nothing when the file or the line is missing.
std::optional<uint64_t> mem_available(const std::string& meminfo);

// The tightest limit - usage over this process's memory cgroups and their ancestors, with what bounded
// it ("cgroup v1 /a: limit 1024.0 MiB - usage 10.2 MiB"), or nothing when no group sets a limit.
struct CgroupAvailable {
    uint64_t bytes = 0;
    std::string source;
};
std::optional<CgroupAvailable> cgroup_available(const std::string& proc_cgroup,
                                                const std::string& cgroup_root);

// The budget "auto" stands for. Throws InvalidArgument when neither source is readable, or when what is
// available does not exceed the margin.
AutoRamBudget auto_ram_budget(const MemoryProbePaths& paths = {});

}  // namespace sharpi
