#include "moe/cpu_miss.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <vector>

#include "cpu/ops/expert_ffn.h"
#include "moe/expert_layout.h"
#include "moe/expert_source.h"
#include "sharpi/errors.h"
#include "threads/thread_pool.h"

namespace sharpi {

MissMode parse_miss_mode(const std::string& name) {
    if (name == "copy") return MissMode::copy;
    if (name == "cpu") return MissMode::cpu;
    if (name == "auto") return MissMode::cost;
    throw InvalidArgument("miss route must be \"copy\", \"cpu\" or \"auto\", got \"" + name + "\"");
}

const char* miss_mode_name(MissMode mode) {
    switch (mode) {
        case MissMode::copy:
            return "copy";
        case MissMode::cpu:
            return "cpu";
        case MissMode::cost:
            return "auto";
    }
    return "copy";
}

std::vector<MissRoute> route_misses(MissMode mode, const std::vector<bool>& present,
                                    const MissCostInputs& inputs) {
    // Every miss of a layer has the same inputs, so the cost model answers once for all of them (and
    // only when something is missing: without a miss its inputs are never read, nor checked).
    const bool any_miss = std::find(present.begin(), present.end(), false) != present.end();
    MissRoute miss_route = MissRoute::copy;
    if (mode == MissMode::cpu) {
        miss_route = MissRoute::cpu;
    } else if (mode == MissMode::cost && any_miss) {
        miss_route = choose_miss_route(inputs).route;
    }
    std::vector<MissRoute> routes(present.size(), MissRoute::copy);
    for (size_t i = 0; i < present.size(); ++i) {
        if (!present[i]) routes[i] = miss_route;  // present: in VRAM or on its way, the device computes it
    }
    return routes;
}

double measure_cpu_expert_speed(const ExpertLayout& layout, int64_t n_embd, ThreadPool& pool, bool exact,
                                int repeats) {
    if (repeats < 1)
        throw InvalidArgument("[miss cost] repeats must be >= 1, got " + std::to_string(repeats));
    const auto first = std::find_if(layout.layers.begin(), layout.layers.end(),
                                    [](const ExpertLayerLayout& x) { return x.present(); });
    if (first == layout.layers.end()) throw InvalidArgument("[miss cost] the model has no routed experts");
    const int il = static_cast<int>(first - layout.layers.begin());
    ResidentExperts host(layout);
    const int32_t e = 0;
    ExpertView v;
    host.acquire(il, &e, 1, &v);
    const ExpertFfnWeights w{v.gate, v.up, v.down};
    // A fixed, non-trivial row: the kernel's speed does not depend on the values.
    std::vector<float> x(static_cast<size_t>(n_embd)), out(static_cast<size_t>(n_embd));
    for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.1f * static_cast<float>(i));
    const float one = 1.0f;
    cpu::expert_ffn_one_token(pool, &w, &one, 1, x.data(), out.data(), exact);  // warm caches and the pool
    std::vector<double> seconds;
    for (int r = 0; r < repeats; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        cpu::expert_ffn_one_token(pool, &w, &one, 1, x.data(), out.data(), exact);
        seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::nth_element(seconds.begin(), seconds.begin() + repeats / 2, seconds.end());
    const double s = std::max(seconds[static_cast<size_t>(repeats / 2)], 1e-9);
    return static_cast<double>(layout.expert_bytes(il)) / s;
}

}  // namespace sharpi
