// Prefetch sizing: how many of a predictor's hints the prefetcher turns into reads
// (docs/predictors.md, "Byte-sized prediction sets").
//
// "topk" keeps the best top_k hints of each target layer (prediction set size = k). "bytes" sizes
// each set by expected stall saved: a hint's score becomes a selection probability
//     p_e = min(1, k * softmax(scores of the target layer's hints)_e)
// (not a calibrated probability, a documented rule: the predictors' scores are logits or ranks),
// and an expert e of target layer t with bytes b_e, read at the reader's measured bandwidth B, is
// worth
//     saving_e = p_e * b_e / B - (1 - p_e) * b_e / B        (ms)
// where b_e / B is the stall a demand read of e would cost and (1 - p_e) * b_e / B the expected
// reader time a wasted read takes from demand reads, provided the read can start before t's gate
// (queued / B <= (t - source) * layer_ms, the timeliness test of the top-k sizing; a read that
// can only start later saves nothing and is not issued). The prediction set of t is
// {e : p_e > 1/2} (positive saving); its experts not already cached or loading are read best
// saving first, one at a time (each issued read adds its bytes to the queue ahead of the next),
// while the saving is positive, the read timely and a staging slot free.
//
// Pure functions of their inputs (no cache, no reader), so tests compare them with a numpy model.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "sharpi/predictor.h"

namespace sharpi {

enum class PrefetchSizing { topk, bytes };

// "topk" or "bytes"; anything else is an InvalidArgument naming both.
PrefetchSizing parse_prefetch_sizing(const std::string& name);

// Orders one call's hints as the prefetcher considers them: nearest target layer first, best score
// first within a layer (stable: equal scores keep the predictor's order).
void order_hints(std::vector<PrefetchHint>& hints);

// The reader's state when a call's reads are planned.
struct ReaderLoad {
    double bytes_per_ms = 0.0;  // measured bandwidth (0: not measured yet)
    double queued_bytes = 0.0;  // bytes in flight or queued ahead of a new read
    double layer_ms = 0.0;      // time from one layer's gate to the next (0: not measured yet)
    bool timeliness = true;     // count only the part of a read that can finish before its gate
    uint64_t free_slots = 0;    // staging slots free for new reads
};

struct ByteSizedPrefetch {
    // Per target layer (ascending): the prediction set {p > 1/2}, best score first.
    std::vector<std::pair<int, std::vector<int32_t>>> sets;
    // The reads to issue, in order: (target layer, expert).
    std::vector<std::pair<int, int32_t>> reads;
    // Set members that were neither present nor read (late, no positive saving, or no slot).
    std::vector<std::pair<int, int32_t>> skipped;
};

// Plans one predictor call's prefetches under the "bytes" rule above. `hints` must be valid for
// source layer `source_layer` (target in range, expert in range, score not NaN) and ordered by
// order_hints; a repeated (target, expert) counts once, with its first (best) score. `present(t, e)`:
// cached or loading (needs no read); `expert_bytes(t)`: bytes of one expert of layer t.
void plan_byte_sized_prefetch(int source_layer, int top_k, const std::vector<PrefetchHint>& hints,
                              const std::function<bool(int, int32_t)>& present,
                              const std::function<double(int)>& expert_bytes, const ReaderLoad& load,
                              ByteSizedPrefetch& out);

}  // namespace sharpi
