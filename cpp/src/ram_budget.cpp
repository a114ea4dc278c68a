#include "ram_budget.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <tuple>
#include <vector>

#include "sharpi/errors.h"
#include "sharpi/options.h"

namespace sharpi {

namespace {

namespace fs = std::filesystem;

constexpr double kMiB = 1024.0 * 1024.0;
constexpr int64_t kNoLimit = int64_t{1} << 62;  // v1 reports "unlimited" as a page-rounded 2^63 - 1

std::string mib(double bytes, int decimals = 1) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.*f", decimals, bytes / kMiB);
    return buf;
}

bool read_text(const std::string& path, std::string& text) {
    std::ifstream in(path);
    if (!in) return false;
    std::ostringstream s;
    s << in.rdbuf();
    text = s.str();
    return !in.bad();
}

std::string strip(const std::string& text) {
    const size_t first = text.find_first_not_of(" \t\n\r\f\v");
    if (first == std::string::npos) return "";
    return text.substr(first, text.find_last_not_of(" \t\n\r\f\v") - first + 1);
}

// A cgroup file's number, or nothing for a missing file, "max", a non-number or a v1 "unlimited".
std::optional<int64_t> read_limit(const fs::path& path) {
    std::string text;
    if (!read_text(path.string(), text)) return std::nullopt;
    text = strip(text);
    if (text.empty() || text == "max") return std::nullopt;
    errno = 0;
    char* end = nullptr;
    const long long value = std::strtoll(text.c_str(), &end, 10);
    if (end == text.c_str() || *end != '\0') return std::nullopt;
    if (errno == ERANGE) return value > 0 ? std::nullopt : std::optional<int64_t>(value);
    return value < kNoLimit ? std::optional<int64_t>(value) : std::nullopt;
}

// "a/b/" and "a/b" alike: lexically normal, no trailing separator (the root stays "/").
fs::path normal(const fs::path& p) {
    fs::path n = p.lexically_normal();
    const std::string s = n.string();
    if (s.size() > 1 && s.back() == '/') n = fs::path(s.substr(0, s.size() - 1));
    return n;
}

struct CgroupDir {
    std::string version;  // "v1" or "v2"
    fs::path mount;       // the controller's mount point
    fs::path here;        // this process's group under it
};

// The memory cgroups named in proc_cgroup (v1 "N:...memory...:/path", v2 "0::/path").
std::vector<CgroupDir> cgroup_dirs(const std::string& proc_cgroup, const std::string& cgroup_root) {
    std::string text;
    if (!read_text(proc_cgroup, text)) return {};
    std::vector<CgroupDir> out;
    std::istringstream lines(text);
    std::string line;
    while (std::getline(lines, line)) {
        const size_t c1 = line.find(':');
        if (c1 == std::string::npos) continue;
        const size_t c2 = line.find(':', c1 + 1);
        if (c2 == std::string::npos) continue;
        const std::string id = line.substr(0, c1), controllers = line.substr(c1 + 1, c2 - c1 - 1);
        std::string path = line.substr(c2 + 1);
        bool memory = false;
        std::istringstream names(controllers);
        for (std::string name; std::getline(names, name, ',');) memory = memory || name == "memory";
        CgroupDir d;
        if (memory) {
            d.version = "v1";
            d.mount = fs::path(cgroup_root) / "memory";
        } else if (controllers.empty() && id == "0") {
            const fs::path unified = fs::path(cgroup_root) / "unified";
            std::error_code ec;
            d.version = "v2";
            d.mount = fs::is_directory(unified, ec) ? unified : fs::path(cgroup_root);
        } else {
            continue;
        }
        path.erase(0, path.find_first_not_of('/'));
        d.here = d.mount / path;
        std::error_code ec;
        if (!fs::is_directory(d.here, ec)) d.here = d.mount;  // a container that sees its group as the root
        out.push_back(d);
    }
    return out;
}

}  // namespace

std::string AutoRamBudget::describe() const {
    return "--ram-budget auto: " + mib(static_cast<double>(budget)) +
           " MiB = " + mib(static_cast<double>(available)) + " MiB available (" + source + ") - margin " +
           mib(static_cast<double>(margin)) + " MiB";
}

std::optional<uint64_t> mem_available(const std::string& meminfo) {
    std::string text;
    if (!read_text(meminfo, text)) return std::nullopt;
    std::istringstream lines(text);
    std::string line;
    while (std::getline(lines, line)) {
        if (line.rfind("MemAvailable:", 0) != 0) continue;
        std::istringstream fields(line.substr(13));
        uint64_t kib = 0;
        if (!(fields >> kib)) return std::nullopt;
        return kib * 1024;
    }
    return std::nullopt;
}

std::optional<CgroupAvailable> cgroup_available(const std::string& proc_cgroup,
                                                const std::string& cgroup_root) {
    std::optional<CgroupAvailable> best;
    for (const CgroupDir& g : cgroup_dirs(proc_cgroup, cgroup_root)) {
        const bool v2 = g.version == "v2";
        const char* limit_name = v2 ? "memory.max" : "memory.limit_in_bytes";
        const char* usage_name = v2 ? "memory.current" : "memory.usage_in_bytes";
        const fs::path mount = normal(g.mount);
        // From this process's group up to the controller's root: a parent's limit binds the child too.
        for (fs::path d = normal(g.here);; d = d.parent_path()) {
            const std::optional<int64_t> limit = read_limit(d / limit_name);
            if (limit) {
                const int64_t usage = read_limit(d / usage_name).value_or(0);
                const uint64_t left = static_cast<uint64_t>(std::max<int64_t>(0, *limit - usage));
                if (!best || left < best->bytes) {
                    const std::string rel = d == mount ? "/" : "/" + d.lexically_relative(mount).string();
                    best = CgroupAvailable{left, "cgroup " + g.version + " " + rel + ": limit " +
                                                     mib(static_cast<double>(*limit)) + " MiB - usage " +
                                                     mib(static_cast<double>(usage)) + " MiB"};
                }
            }
            if (d == mount || d.parent_path() == d) break;
        }
    }
    return best;
}

AutoRamBudget auto_ram_budget(const MemoryProbePaths& paths) {
    // The smallest bound wins; on a tie the description that sorts first (as Python's min() of pairs).
    std::vector<std::pair<uint64_t, std::string>> candidates;
    if (const std::optional<uint64_t> avail = mem_available(paths.meminfo))
        candidates.emplace_back(*avail, "MemAvailable");
    if (const std::optional<CgroupAvailable> cg = cgroup_available(paths.proc_cgroup, paths.cgroup_root))
        candidates.emplace_back(cg->bytes, cg->source);
    if (candidates.empty())
        throw InvalidArgument("--ram-budget auto: found neither /proc/meminfo nor a cgroup memory limit");
    const auto& [available, source] = *std::min_element(candidates.begin(), candidates.end());
    const uint64_t margin =
        std::max<uint64_t>(kRamBudgetMarginMin,
                           static_cast<uint64_t>(static_cast<double>(available) * kRamBudgetMarginFraction));
    if (available <= margin) {
        throw InvalidArgument("--ram-budget auto: only " + mib(static_cast<double>(available)) +
                              " MiB available (" + source + "), less than the " +
                              mib(static_cast<double>(margin), 0) + " MiB margin");
    }
    AutoRamBudget a;
    a.budget = available - margin;
    a.available = available;
    a.margin = margin;
    a.source = source;
    return a;
}

}  // namespace sharpi
