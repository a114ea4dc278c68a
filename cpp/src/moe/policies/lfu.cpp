// LfuPolicy: least frequently used, with exponential decay (aging). Each expert has a score, the
// sum over its uses (touches and inserts) of 2^(t / half_life), t counting uses of every expert:
// a use half_life uses ago weighs half as much as one now, so a once-hot expert that went cold
// loses to the experts used now. Scores belong to the expert (ExpertKey), not the slot, and
// outlive evictions: the universe of experts is small (n_layer * n_expert), and an expert evicted
// after many uses comes back with its history, which is what frequency means for routed experts
// (popularity per layer is skewed and stable over a sequence).
//
// Victims: the lowest score, the least recently used among equals, skipping slots the caller may
// not evict. Order is kept in a set keyed by (score, last use); a score changes only when its
// expert is used, since decay is a growing weight for new uses rather than a shrinking one for
// old ones, so the order needs no periodic rescan. When the weight grows large every score is
// divided by it (order unchanged).
#include <algorithm>
#include <cmath>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "moe/replacement_policy.h"
#include "sharpi/errors.h"

namespace sharpi {

namespace {

class LfuPolicy final : public ReplacementPolicy {
  public:
    explicit LfuPolicy(double half_life) : growth_(std::exp2(1.0 / half_life)) {}

    const char* name() const override { return "lfu"; }
    void insert(uint32_t slot, ExpertKey key) override {
        remove(slot);
        if (slot >= slots_.size()) slots_.resize(static_cast<size_t>(slot) + 1);
        Slot& s = slots_[slot];
        s.in = true;
        s.key = pack(key);
        s.score = scores_[s.key];
        use(slot);
    }
    void touch(uint32_t slot) override {
        if (!contains(slot)) return;
        order_.erase(entry(slot));
        use(slot);
    }
    void remove(uint32_t slot) override {
        if (!contains(slot)) return;
        order_.erase(entry(slot));
        slots_[slot].in = false;
    }
    bool contains(uint32_t slot) const override { return slot < slots_.size() && slots_[slot].in; }
    size_t size() const override { return order_.size(); }
    uint32_t victim(const Evictable& evictable) override {
        for (const auto& [score, last, slot] : order_) {
            (void)score;
            (void)last;
            if (evictable(slot)) return slot;
        }
        return kNone;
    }

  private:
    struct Slot {
        bool in = false;
        uint64_t key = 0;
        double score = 0.0;
        uint64_t last = 0;  // use counter at its last use
    };
    using Entry = std::tuple<double, uint64_t, uint32_t>;  // (score, last use, slot): victims first

    static uint64_t pack(ExpertKey k) {
        return (static_cast<uint64_t>(static_cast<uint32_t>(k.layer)) << 32) |
               static_cast<uint32_t>(k.expert);
    }
    Entry entry(uint32_t slot) const {
        const Slot& s = slots_[slot];
        return {s.score, s.last, slot};
    }
    void use(uint32_t slot) {
        Slot& s = slots_[slot];
        s.score += weight_;
        s.last = ++clock_;
        scores_[s.key] = s.score;
        order_.insert(entry(slot));
        weight_ *= growth_;
        if (weight_ > kRescaleAt) rescale();
    }
    // Divides every score and the weight by the weight: same order, no overflow.
    void rescale() {
        for (auto& [key, score] : scores_) score /= weight_;
        order_.clear();
        for (uint32_t slot = 0; slot < slots_.size(); ++slot) {
            if (!slots_[slot].in) continue;
            slots_[slot].score /= weight_;
            order_.insert(entry(slot));
        }
        weight_ = 1.0;
    }

    static constexpr double kRescaleAt = 1e150;
    const double growth_;  // weight_ grows by this per use: 2 every half_life uses
    double weight_ = 1.0;  // what the next use adds to its expert's score
    uint64_t clock_ = 0;
    std::vector<Slot> slots_;
    std::set<Entry> order_;                        // cached slots, victim first
    std::unordered_map<uint64_t, double> scores_;  // every expert ever seen -> its score
};

}  // namespace

std::unique_ptr<ReplacementPolicy> make_lfu_policy(uint64_t capacity,
                                                   const ReplacementPolicyOptions& options) {
    if (!(options.lfu_half_life >= 0.0) || !std::isfinite(options.lfu_half_life)) {
        throw InvalidArgument(
            "[cache] LFU half-life must be a positive number of uses (0: 4 x capacity), got " +
            std::to_string(options.lfu_half_life));
    }
    const double half_life = options.lfu_half_life > 0.0
                                 ? options.lfu_half_life
                                 : 4.0 * static_cast<double>(std::max<uint64_t>(capacity, 1));
    return std::make_unique<LfuPolicy>(half_life);
}

}  // namespace sharpi
