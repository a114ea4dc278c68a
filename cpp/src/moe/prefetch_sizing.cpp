#include "moe/prefetch_sizing.h"

#include <algorithm>
#include <cmath>

#include "sharpi/errors.h"

namespace sharpi {

PrefetchSizing parse_prefetch_sizing(const std::string& name) {
    if (name == "topk") return PrefetchSizing::topk;
    if (name == "bytes") return PrefetchSizing::bytes;
    throw InvalidArgument("prefetch_sizing must be \"topk\" or \"bytes\", not \"" + name + "\"");
}

void order_hints(std::vector<PrefetchHint>& hints) {
    std::stable_sort(hints.begin(), hints.end(), [](const PrefetchHint& a, const PrefetchHint& b) {
        return a.target_layer < b.target_layer || (a.target_layer == b.target_layer && a.score > b.score);
    });
}

namespace {

// One distinct expert of a target layer that needs a read.
struct Candidate {
    int target_layer;
    int32_t expert;
    double probability;
    double bytes;
};

// p_i = min(1, k * softmax(scores)_i), in double. An infinite maximum (a plug-in's +inf, or all
// -inf) gives each expert at the maximum weight 1 and the others exp(-inf) = 0.
void selection_probabilities(const std::vector<double>& scores, int top_k, std::vector<double>& p) {
    const double top = *std::max_element(scores.begin(), scores.end());
    p.resize(scores.size());
    double sum = 0.0;
    for (size_t i = 0; i < scores.size(); ++i) {
        p[i] = scores[i] == top ? 1.0 : std::exp(scores[i] - top);
        sum += p[i];
    }
    for (double& v : p) v = std::min(1.0, static_cast<double>(top_k) * v / sum);
}

}  // namespace

void plan_byte_sized_prefetch(int source_layer, int top_k, const std::vector<PrefetchHint>& hints,
                              const std::function<bool(int, int32_t)>& present,
                              const std::function<double(int)>& expert_bytes, const ReaderLoad& load,
                              ByteSizedPrefetch& out) {
    out.sets.clear();
    out.reads.clear();
    out.skipped.clear();
    std::vector<Candidate> candidates;
    std::vector<int32_t> experts;
    std::vector<double> scores, p;
    size_t i = 0;
    while (i < hints.size()) {
        const int t = hints[i].target_layer;
        experts.clear();
        scores.clear();
        for (; i < hints.size() && hints[i].target_layer == t; ++i) {
            if (std::find(experts.begin(), experts.end(), hints[i].expert) != experts.end()) continue;
            experts.push_back(hints[i].expert);
            scores.push_back(static_cast<double>(hints[i].score));
        }
        selection_probabilities(scores, top_k, p);
        std::vector<int32_t> set;
        for (size_t j = 0; j < experts.size(); ++j) {
            if (!(p[j] > 0.5)) continue;
            set.push_back(experts[j]);
            if (!present(t, experts[j]))
                candidates.push_back(Candidate{t, experts[j], p[j], expert_bytes(t)});
        }
        if (!set.empty()) out.sets.emplace_back(t, std::move(set));
    }

    // Greedy, best expected saving first: each read issued queues its bytes ahead of the next ones.
    const bool timed = load.timeliness && load.bytes_per_ms > 0.0 && load.layer_ms > 0.0;
    const double bytes_per_ms = load.bytes_per_ms > 0.0 ? load.bytes_per_ms : 1.0;  // unmeasured: in bytes
    double queued = load.queued_bytes;
    uint64_t free_slots = load.free_slots;
    std::vector<bool> taken(candidates.size(), false);
    while (free_slots > 0) {
        ptrdiff_t best = -1;
        double best_saving = 0.0;
        for (size_t c = 0; c < candidates.size(); ++c) {
            if (taken[c]) continue;
            const Candidate& cand = candidates[c];
            // A read that could only start after t's gate saves nothing (the prefetcher's
            // timeliness test); one that starts before it is ahead of the demand reads it would
            // have queued with at the gate, so it saves its whole read time.
            if (timed && queued / bytes_per_ms > (cand.target_layer - source_layer) * load.layer_ms) continue;
            const double read_ms = cand.bytes / bytes_per_ms;
            const double saving = cand.probability * read_ms - (1.0 - cand.probability) * read_ms;
            if (saving > best_saving) {
                best = static_cast<ptrdiff_t>(c);
                best_saving = saving;
            }
        }
        if (best < 0) break;
        taken[static_cast<size_t>(best)] = true;
        const Candidate& cand = candidates[static_cast<size_t>(best)];
        out.reads.emplace_back(cand.target_layer, cand.expert);
        queued += cand.bytes;
        --free_slots;
    }
    for (size_t c = 0; c < candidates.size(); ++c)
        if (!taken[c]) out.skipped.emplace_back(candidates[c].target_layer, candidates[c].expert);
}

}  // namespace sharpi
