// ReplacementPolicy: which cached expert the expert cache evicts next (DESIGN §4, §11: "cache
// policy is a parameter of the cache, not a fork of it").
//
// Owns only an order over slot ids (small integers the caller hands out); never slot memory,
// states or I/O, and it never decides on its own to drop anything: the cache (or a Python trace
// replay, python/sharpi/belady.py) tells it what entered, what was used and what left, and asks
// it for a victim among the slots it may evict (unpinned, not loading). Staged prefetches are not
// in the policy until the gate adopts them. One thread at a time (the decode thread).
//
// Adding a policy is one file under moe/policies/ (a class implementing this interface and its
// factory, like policies/slru.cpp) plus one row in the policy table (moe/replacement_policy.cpp).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace sharpi {

class ReplacementPolicy {
  public:
    static constexpr uint32_t kNone = UINT32_MAX;
    using Evictable = std::function<bool(uint32_t slot)>;

    virtual ~ReplacementPolicy() = default;
    virtual const char* name() const = 0;
    // `slot` now caches an expert (a miss filled, or a staged prefetch adopted). Not yet in.
    virtual void insert(uint32_t slot) = 0;
    // A cached slot was used again (a hit).
    virtual void touch(uint32_t slot) = 0;
    // `slot` left the cache (evicted or freed); a slot not in the policy is ignored.
    virtual void remove(uint32_t slot) = 0;
    virtual bool contains(uint32_t slot) const = 0;
    virtual size_t size() const = 0;
    // The slot to evict next among those for which evictable(slot) holds, or kNone. Pure: the
    // caller evicts it (and calls remove) or not.
    virtual uint32_t victim(const Evictable& evictable) const = 0;
};

// Knobs of every policy in one struct (a policy reads the ones it has and ignores the rest).
struct ReplacementPolicyOptions {
    // SLRU: share of the capacity in probation, in (0, 1]; 1 leaves no protected segment, which
    // makes SLRU exactly LRU.
    double probation = 0.25;
};

// The policies by name: "slru" (DESIGN §4). capacity: the most slots the cache holds at once.
// Throws InvalidArgument for an unknown name or an option out of range.
std::unique_ptr<ReplacementPolicy> make_replacement_policy(const std::string& name, uint64_t capacity,
                                                           const ReplacementPolicyOptions& options);
std::vector<std::string> replacement_policy_names();

}  // namespace sharpi
