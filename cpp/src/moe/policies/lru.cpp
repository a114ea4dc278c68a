// LruPolicy: least recently used. One recency list; insert and touch move a slot to the hot end,
// victims come from the cold end, skipping slots the caller may not evict. The baseline every
// other policy is compared with (docs/cache_policies.md).
#include <list>
#include <memory>
#include <vector>

#include "moe/replacement_policy.h"

namespace sharpi {

namespace {

class LruPolicy final : public ReplacementPolicy {
  public:
    const char* name() const override { return "lru"; }
    void insert(uint32_t slot, ExpertKey) override { push(slot); }
    void touch(uint32_t slot) override { push(slot); }
    void remove(uint32_t slot) override {
        if (!contains(slot)) return;
        order_.erase(at_[slot]);
        in_[slot] = false;
    }
    bool contains(uint32_t slot) const override { return slot < in_.size() && in_[slot]; }
    size_t size() const override { return order_.size(); }
    uint32_t victim(const Evictable& evictable) override {
        for (auto it = order_.rbegin(); it != order_.rend(); ++it) {
            if (evictable(*it)) return *it;
        }
        return kNone;
    }

  private:
    void push(uint32_t slot) {
        remove(slot);
        if (slot >= in_.size()) {
            in_.resize(static_cast<size_t>(slot) + 1, false);
            at_.resize(in_.size());
        }
        order_.push_front(slot);
        at_[slot] = order_.begin();
        in_[slot] = true;
    }

    std::list<uint32_t> order_;  // front = most recently used
    std::vector<std::list<uint32_t>::iterator> at_;
    std::vector<bool> in_;
};

}  // namespace

std::unique_ptr<ReplacementPolicy> make_lru_policy(uint64_t, const ReplacementPolicyOptions&) {
    return std::make_unique<LruPolicy>();
}

}  // namespace sharpi
