// The policy table: the only place that lists the replacement policies by name. Each policy is one
// file under moe/policies/ defining its factory; adding one is that file plus one row here.
#include "moe/replacement_policy.h"

#include "sharpi/errors.h"

namespace sharpi {

using PolicyFactory = std::unique_ptr<ReplacementPolicy> (*)(uint64_t capacity,
                                                             const ReplacementPolicyOptions& options);

std::unique_ptr<ReplacementPolicy> make_slru_policy(uint64_t capacity,
                                                    const ReplacementPolicyOptions& options);

namespace {

struct PolicyRow {
    const char* name;
    PolicyFactory make;
};

const PolicyRow kPolicyTable[] = {
    {"slru", make_slru_policy},
};

}  // namespace

std::unique_ptr<ReplacementPolicy> make_replacement_policy(const std::string& name, uint64_t capacity,
                                                           const ReplacementPolicyOptions& options) {
    for (const PolicyRow& row : kPolicyTable) {
        if (name == row.name) return row.make(capacity, options);
    }
    std::string known;
    for (const std::string& n : replacement_policy_names()) known += (known.empty() ? "" : ", ") + n;
    throw InvalidArgument("[cache] unknown replacement policy '" + name + "' (known: " + known + ")");
}

std::vector<std::string> replacement_policy_names() {
    std::vector<std::string> names;
    for (const PolicyRow& row : kPolicyTable) names.emplace_back(row.name);
    return names;
}

}  // namespace sharpi
