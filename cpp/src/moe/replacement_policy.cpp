#include "moe/replacement_policy.h"

#include "moe/slru_policy.h"
#include "sharpi/errors.h"

namespace sharpi {

std::unique_ptr<ReplacementPolicy> make_replacement_policy(const std::string& name, uint64_t capacity,
                                                           const ReplacementPolicyOptions& options) {
    if (name == "slru") return std::make_unique<SlruPolicy>(capacity, options.probation);
    std::string known;
    for (const std::string& n : replacement_policy_names()) known += (known.empty() ? "" : ", ") + n;
    throw InvalidArgument("[cache] unknown replacement policy '" + name + "' (known: " + known + ")");
}

std::vector<std::string> replacement_policy_names() {
    return {"slru"};
}

}  // namespace sharpi
