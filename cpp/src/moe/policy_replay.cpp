#include "moe/policy_replay.h"

#include <algorithm>
#include <string>
#include <unordered_map>

#include "sharpi/errors.h"

namespace sharpi {

namespace {

uint64_t pack(int32_t layer, int32_t expert) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(layer)) << 32) | static_cast<uint32_t>(expert);
}

}  // namespace

std::vector<uint32_t> replay_policy(ReplacementPolicy& policy, uint64_t capacity, const ReplaySteps& steps) {
    const size_t n_steps = steps.layer.size();
    const bool hinted = !steps.hint_offsets.empty();
    if (steps.offsets.size() != n_steps + 1 || steps.offsets.front() != 0 ||
        steps.offsets.back() != static_cast<int64_t>(steps.experts.size()) ||
        (hinted && (steps.hint_offsets.size() != n_steps + 1 || steps.hint_offsets.front() != 0 ||
                    steps.hint_offsets.back() != static_cast<int64_t>(steps.hint_layer.size()) ||
                    steps.hint_layer.size() != steps.hint_expert.size()))) {
        throw InvalidArgument("[cache] replay: step arrays disagree in length");
    }
    std::unordered_map<uint64_t, uint32_t> slot_of;  // cached key -> slot
    std::vector<uint64_t> key_of(capacity);
    std::vector<uint32_t> free_slots;
    for (uint64_t s = capacity; s > 0; --s) free_slots.push_back(static_cast<uint32_t>(s - 1));
    std::vector<char> pinned(capacity, 0);
    std::vector<uint32_t> pins, misses(n_steps, 0);
    std::vector<int32_t> missing;

    for (size_t i = 0; i < n_steps; ++i) {
        const int32_t il = steps.layer[i];
        const int64_t b = steps.offsets[i], e = steps.offsets[i + 1];
        if (e < b || static_cast<uint64_t>(e - b) > capacity) {
            throw InvalidArgument("[cache] replay: step " + std::to_string(i) + " needs " +
                                  std::to_string(e - b) + " experts but the cache holds " +
                                  std::to_string(capacity));
        }
        policy.gate(il);
        pins.clear();
        missing.clear();
        for (int64_t j = b; j < e; ++j) {
            const int32_t x = steps.experts[static_cast<size_t>(j)];
            if (std::find(steps.experts.begin() + b, steps.experts.begin() + j, x) !=
                steps.experts.begin() + j)
                throw InvalidArgument("[cache] replay: step " + std::to_string(i) + " names expert " +
                                      std::to_string(x) + " twice");
            auto it = slot_of.find(pack(il, x));
            if (it == slot_of.end()) {
                missing.push_back(x);
                continue;
            }
            policy.touch(it->second);
            pinned[it->second] = 1;
            pins.push_back(it->second);
        }
        for (int32_t x : missing) {
            uint32_t s;
            if (policy.size() < capacity && !free_slots.empty()) {
                s = free_slots.back();
                free_slots.pop_back();
            } else {
                s = policy.victim([&](uint32_t v) { return !pinned[v]; });
                if (s == ReplacementPolicy::kNone) throw Error("[cache] replay: policy found no victim");
                policy.remove(s);
                slot_of.erase(key_of[s]);
            }
            policy.insert(s, ExpertKey{il, x});
            key_of[s] = pack(il, x);
            slot_of[key_of[s]] = s;
            pinned[s] = 1;
            pins.push_back(s);
        }
        misses[i] = static_cast<uint32_t>(missing.size());
        for (uint32_t s : pins) pinned[s] = 0;  // release
        if (hinted) {
            for (int64_t j = steps.hint_offsets[i]; j < steps.hint_offsets[i + 1]; ++j) {
                const int32_t t = steps.hint_layer[static_cast<size_t>(j)];
                auto it = slot_of.find(pack(t, steps.hint_expert[static_cast<size_t>(j)]));
                if (it != slot_of.end()) policy.protect(it->second, t);
            }
        }
    }
    return misses;
}

}  // namespace sharpi
