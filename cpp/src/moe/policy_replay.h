// Trace replay of a replacement policy: the expert cache's call protocol without slots or I/O, so
// that an offline comparison (python/sharpi/cache_eval.py, docs/cache_policies.md) measures the
// very calls ExpertCache::acquire makes on a demand-only cache (no prefetch) with `capacity` slots.
//
// A step is one acquire: the experts one layer needs at once, in acquisition order. Per step, as in
// ExpertCache::acquire: gate(layer); the step's cached experts are touched in order (and pinned);
// then each missing one, in order, takes a free slot or evicts the policy's victim among unpinned
// slots, and is inserted (and pinned). Then the step's hints, (target layer, expert) pairs the
// prefetcher would pass on after this layer's gate, protect the hinted experts that are cached.
// Slots are handed out as the cache does (last freed first), though no policy may depend on ids.
#pragma once

#include <cstdint>
#include <vector>

#include "moe/replacement_policy.h"

namespace sharpi {

struct ReplaySteps {
    std::vector<int32_t> layer;         // [n_steps]
    std::vector<int64_t> offsets;       // [n_steps + 1] into experts
    std::vector<int32_t> experts;       // every step's experts, distinct within a step
    std::vector<int64_t> hint_offsets;  // empty, or [n_steps + 1] into hint_layer / hint_expert
    std::vector<int32_t> hint_layer, hint_expert;
};

// Misses of each step. Throws InvalidArgument when a step needs more experts than `capacity`, a
// step repeats an expert, or the arrays disagree in length.
std::vector<uint32_t> replay_policy(ReplacementPolicy& policy, uint64_t capacity, const ReplaySteps& steps);

}  // namespace sharpi
