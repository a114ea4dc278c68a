#include "moe/miss_cost.h"

#include <string>

#include "sharpi/errors.h"

namespace sharpi {

MissCost choose_miss_route(const MissCostInputs& in) {
    if (!(in.copy_bytes_per_s > 0.0) || !(in.cpu_bytes_per_s > 0.0)) {
        throw InvalidArgument("[miss cost] bandwidths must be > 0 bytes/s, got copy " +
                              std::to_string(in.copy_bytes_per_s) + ", cpu " +
                              std::to_string(in.cpu_bytes_per_s));
    }
    if (!(in.copy_latency_s >= 0.0))
        throw InvalidArgument("[miss cost] copy latency must be >= 0 s, got " +
                              std::to_string(in.copy_latency_s));
    if (in.n_tokens < 1 || in.n_embd < 1) {
        throw InvalidArgument("[miss cost] n_tokens and n_embd must be >= 1, got " +
                              std::to_string(in.n_tokens) + " and " + std::to_string(in.n_embd));
    }
    const double rows = static_cast<double>(in.n_tokens);
    const double bytes = static_cast<double>(in.expert_bytes);
    const double row_bytes = static_cast<double>(in.n_embd) * sizeof(float);
    MissCost c;
    c.copy_s = in.copy_latency_s + bytes / in.copy_bytes_per_s;
    c.cpu_s = 2.0 * in.copy_latency_s + 2.0 * rows * row_bytes / in.copy_bytes_per_s +
              rows * bytes / in.cpu_bytes_per_s;
    c.route = c.cpu_s < c.copy_s ? MissRoute::cpu : MissRoute::copy;
    return c;
}

const char* miss_route_name(MissRoute route) {
    return route == MissRoute::cpu ? "cpu" : "copy";
}

}  // namespace sharpi
