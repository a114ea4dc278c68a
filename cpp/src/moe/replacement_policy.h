// ReplacementPolicy: which cached expert the expert cache evicts next (docs/design.md §4, §11: "cache
// policy is a parameter of the cache, not a fork of it").
//
// Owns only an order over slot ids (small integers the caller hands out) and, for policies that
// remember experts beyond their stay in the cache (ARC's and S3-FIFO's ghosts, LFU's counts, the
// prior's table), per-expert history keyed by ExpertKey; never slot memory, states or I/O, and it
// never decides on its own to drop anything: the cache (or a trace replay, moe/policy_replay.h)
// tells it what entered, what was used and what left, and asks it for a victim among the slots it
// may evict (unpinned, not loading). Staged prefetches are not in the policy until the gate adopts
// them. One thread at a time (the decode thread).
//
// Call protocol (ExpertCache::acquire and replay_policy follow it identically): gate(il) when layer
// il's gate fires, then touch() for each of its experts already cached, then for each missing one
// victim() + remove() when the cache is full, and insert(). protect() may come at any time between
// gates (the prefetcher's hints for later layers).
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

// One expert of one MoE layer: what a slot holds.
struct ExpertKey {
    int32_t layer = -1;
    int32_t expert = -1;
};

class ReplacementPolicy {
  public:
    static constexpr uint32_t kNone = UINT32_MAX;
    using Evictable = std::function<bool(uint32_t slot)>;

    virtual ~ReplacementPolicy() = default;
    virtual const char* name() const = 0;
    // `slot` now caches expert `key` (a miss filled, or a staged prefetch adopted). Not yet in.
    virtual void insert(uint32_t slot, ExpertKey key) = 0;
    // A cached slot was used again (a hit).
    virtual void touch(uint32_t slot) = 0;
    // `slot` left the cache (evicted or freed); a slot not in the policy is ignored.
    virtual void remove(uint32_t slot) = 0;
    virtual bool contains(uint32_t slot) const = 0;
    virtual size_t size() const = 0;
    // The slot to evict next among those for which evictable(slot) holds, or kNone. The caller
    // evicts it (and calls remove) or not. It may reorder the policy's own queues (S3-FIFO moves a
    // reused entry to its main queue while it looks), but never changes which slots are held.
    virtual uint32_t victim(const Evictable& evictable) = 0;

    // Layer il's gate fired (its experts are about to be touched or inserted). A clock for policies
    // that age or expire something per layer; ignored by default.
    virtual void gate(int il) { (void)il; }
    // The predictor expects `slot` (cached) to be needed by layer `il`: keep it until il's gate if
    // anything else can go. Ignored by policies that do not use hints.
    virtual void protect(uint32_t slot, int il) {
        (void)slot;
        (void)il;
    }
};

// Knobs of every policy in one struct (a policy reads the ones it has and ignores the rest).
struct ReplacementPolicyOptions {
    // SLRU: share of the capacity in probation, in (0, 1]; 1 leaves no protected segment, which
    // makes SLRU exactly LRU.
    double probation = 0.25;
    // LFU: accesses (touches and inserts) over which an expert's count decays by half, > 0; 0 picks
    // 4 x capacity (measured best on real routing across budgets, docs/cache_policies.md).
    double lfu_half_life = 0.0;
    // S3-FIFO: share of the capacity in the small FIFO, in (0, 1).
    double s3fifo_small = 0.1;
    // prior: share of the capacity reserved for the experts the prior ranks hottest, in [0, 1].
    double prior_pin = 0.5;
    // prior: expected use of each expert, [n_layer * n_expert] (layer-major; any non-negative scale),
    // learned from a trace (read_cache_prior, gguf/cache_prior_file.h). Empty for other policies.
    std::vector<float> prior;
    int64_t n_layer = 0, n_expert = 0;  // the prior's shape (the model's)
};

// The policies by name: "lru", "slru" (docs/design.md §4), "lfu", "arc", "s3fifo", "prior", "predictive".
// capacity: the most slots the cache holds at once. Throws InvalidArgument for an unknown name
// (listing the known ones), an option out of range, or "prior" without a prior.
std::unique_ptr<ReplacementPolicy> make_replacement_policy(const std::string& name, uint64_t capacity,
                                                           const ReplacementPolicyOptions& options);
std::vector<std::string> replacement_policy_names();
// Throws InvalidArgument, listing the known names, unless `name` is one of them.
void check_replacement_policy_name(const std::string& name);
// The policy a session uses unless told otherwise: the one that misses least against Belady on
// held-out real routing without needing a file (docs/cache_policies.md).
const char* default_replacement_policy();

}  // namespace sharpi
