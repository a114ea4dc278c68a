// PriorPolicy: a frequency prior learned offline from a harvested trace (sharpi cache-prior,
// docs/cache_policies.md). The experts the prior ranks hottest, as many as a share of the
// capacity, are protected: they are evicted only when nothing else can be (so after warm-up they
// stay, pinned in all but name). Everything else, and the protected experts among themselves, is
// ordered by recency (LRU). The prior is read once at construction ([n_layer * n_expert] expected
// uses, any scale) and never updated: it is what the train sequences said, scored on others.
#include <algorithm>
#include <cmath>
#include <list>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "moe/replacement_policy.h"
#include "sharpi/errors.h"

namespace sharpi {

namespace {

class PriorPolicy final : public ReplacementPolicy {
  public:
    PriorPolicy(uint64_t capacity, const ReplacementPolicyOptions& o)
        : n_layer_(o.n_layer), n_expert_(o.n_expert) {
        // The hottest floor(prior_pin * capacity) experts, ties broken by the lower key.
        const size_t n = o.prior.size();
        std::vector<uint32_t> rank(n);
        std::iota(rank.begin(), rank.end(), 0u);
        const size_t n_hot =
            std::min<size_t>(n, static_cast<size_t>(std::floor(o.prior_pin * static_cast<double>(capacity))));
        std::stable_sort(rank.begin(), rank.end(),
                         [&](uint32_t a, uint32_t b) { return o.prior[a] > o.prior[b]; });
        hot_.assign(n, false);
        for (size_t i = 0; i < n_hot; ++i) {
            if (o.prior[rank[i]] > 0.0f) hot_[rank[i]] = true;
        }
    }

    const char* name() const override { return "prior"; }
    void insert(uint32_t slot, ExpertKey key) override {
        remove(slot);
        if (slot >= slots_.size()) slots_.resize(static_cast<size_t>(slot) + 1);
        slots_[slot].hot = key.layer >= 0 && key.layer < n_layer_ && key.expert >= 0 &&
                           key.expert < n_expert_ &&
                           hot_[static_cast<size_t>(key.layer * n_expert_ + key.expert)];
        push(slot);
    }
    void touch(uint32_t slot) override {
        if (!contains(slot)) return;
        unlink(slot);
        push(slot);
    }
    void remove(uint32_t slot) override {
        if (contains(slot)) unlink(slot);
    }
    bool contains(uint32_t slot) const override { return slot < slots_.size() && slots_[slot].in; }
    size_t size() const override { return cold_.size() + hot_list_.size(); }
    uint32_t victim(const Evictable& evictable) override {
        for (const std::list<uint32_t>* l : {&cold_, &hot_list_}) {
            for (auto it = l->rbegin(); it != l->rend(); ++it) {
                if (evictable(*it)) return *it;
            }
        }
        return kNone;
    }

  private:
    struct Slot {
        bool in = false, hot = false;
        std::list<uint32_t>::iterator at;
    };
    void push(uint32_t slot) {
        Slot& s = slots_[slot];
        std::list<uint32_t>& l = s.hot ? hot_list_ : cold_;
        l.push_front(slot);
        s.at = l.begin();
        s.in = true;
    }
    void unlink(uint32_t slot) {
        Slot& s = slots_[slot];
        (s.hot ? hot_list_ : cold_).erase(s.at);
        s.in = false;
    }

    const int64_t n_layer_, n_expert_;
    std::vector<bool> hot_;                // by layer * n_expert + expert
    std::list<uint32_t> cold_, hot_list_;  // front = most recently used
    std::vector<Slot> slots_;
};

}  // namespace

std::unique_ptr<ReplacementPolicy> make_prior_policy(uint64_t capacity,
                                                     const ReplacementPolicyOptions& options) {
    if (options.prior.empty()) {
        throw InvalidArgument(
            "[cache] the 'prior' policy needs a prior file (--cache-policy prior:FILE; fit one with "
            "`sharpi cache-prior`)");
    }
    if (options.n_layer <= 0 || options.n_expert <= 0 ||
        options.prior.size() != static_cast<size_t>(options.n_layer * options.n_expert)) {
        throw InvalidArgument("[cache] prior of " + std::to_string(options.prior.size()) +
                              " values does not match n_layer " + std::to_string(options.n_layer) +
                              " x n_expert " + std::to_string(options.n_expert));
    }
    for (float v : options.prior) {
        if (!(v >= 0.0f) || !std::isfinite(v))
            throw InvalidArgument("[cache] prior values must be finite and >= 0");
    }
    if (!(options.prior_pin >= 0.0 && options.prior_pin <= 1.0)) {
        throw InvalidArgument("[cache] prior pin share must be in [0, 1], got " +
                              std::to_string(options.prior_pin));
    }
    return std::make_unique<PriorPolicy>(capacity, options);
}

}  // namespace sharpi
