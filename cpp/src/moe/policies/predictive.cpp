// PredictivePolicy: prediction-aware eviction. Orders slots exactly as a base policy does (LFU with
// decay, policies/lfu.cpp) but never evicts a slot the predictor says a coming layer needs while
// any other slot can go. The predictor never touches slots (docs/design.md §3): its hints reach the cache
// through the prefetcher (ExpertCache::hint), and the cache calls protect(slot, il) for each hinted
// expert already cached. A protection lasts until layer il's gate (when the expert is touched if
// the prediction was right, and loses its privilege either way), or until a new token starts.
// Without hints (no predictor) it is its base policy.
#include <algorithm>
#include <memory>
#include <vector>

#include "moe/replacement_policy.h"

namespace sharpi {

std::unique_ptr<ReplacementPolicy> make_lfu_policy(uint64_t capacity,
                                                   const ReplacementPolicyOptions& options);

namespace {

class PredictivePolicy final : public ReplacementPolicy {
  public:
    explicit PredictivePolicy(std::unique_ptr<ReplacementPolicy> base) : base_(std::move(base)) {}

    const char* name() const override { return "predictive"; }
    void insert(uint32_t slot, ExpertKey key) override { base_->insert(slot, key); }
    void touch(uint32_t slot) override { base_->touch(slot); }
    void remove(uint32_t slot) override {
        base_->remove(slot);
        unprotect(slot);
    }
    bool contains(uint32_t slot) const override { return base_->contains(slot); }
    size_t size() const override { return base_->size(); }
    uint32_t victim(const Evictable& evictable) override {
        if (!protected_.empty()) {
            const uint32_t v = base_->victim([&](uint32_t s) { return evictable(s) && until_of(s) < 0; });
            if (v != kNone) return v;
        }
        return base_->victim(evictable);
    }
    void gate(int il) override {
        // A new token (the layer went back) ends every protection; otherwise those for il and before.
        const bool new_token = il < last_gate_;
        last_gate_ = il;
        protected_.erase(std::remove_if(protected_.begin(), protected_.end(),
                                        [&](const Protection& p) { return new_token || p.until <= il; }),
                         protected_.end());
        base_->gate(il);
    }
    void protect(uint32_t slot, int il) override {
        if (!base_->contains(slot)) return;
        for (Protection& p : protected_) {
            if (p.slot == slot) {
                p.until = std::max(p.until, il);
                return;
            }
        }
        protected_.push_back({slot, il});
    }

  private:
    struct Protection {
        uint32_t slot;
        int until;  // layer whose gate ends it
    };
    int until_of(uint32_t slot) const {
        for (const Protection& p : protected_) {
            if (p.slot == slot) return p.until;
        }
        return -1;
    }
    void unprotect(uint32_t slot) {
        protected_.erase(std::remove_if(protected_.begin(), protected_.end(),
                                        [&](const Protection& p) { return p.slot == slot; }),
                         protected_.end());
    }

    std::unique_ptr<ReplacementPolicy> base_;
    std::vector<Protection> protected_;  // few: at most lookahead * top_k hints are alive
    int last_gate_ = -1;
};

}  // namespace

std::unique_ptr<ReplacementPolicy> make_predictive_policy(uint64_t capacity,
                                                          const ReplacementPolicyOptions& options) {
    return std::make_unique<PredictivePolicy>(make_lfu_policy(capacity, options));
}

}  // namespace sharpi
