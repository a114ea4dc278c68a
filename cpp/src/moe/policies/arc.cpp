// ArcPolicy: Adaptive Replacement Cache (Megiddo & Modha, FAST 2003). Two lists of cached slots,
// T1 (seen once since it entered) and T2 (used again), and two ghost lists of experts recently
// evicted from each, B1 and B2 (keys only, no slots). A miss on an expert in B1 says T1 was too
// small: the target size p of T1 grows; a miss on one in B2 shrinks it. Victims come from T1's
// cold end while |T1| > p, else from T2's, falling back to the other list when every slot of the
// chosen one is pinned. Ghosts are bounded as in the paper: |T1| + |B1| <= c and the four lists
// together <= 2c.
//
// One departure: ARC's REPLACE also looks at whether the incoming expert is in B2 to break the
// tie |T1| == p; victim() is asked before the incoming expert is known, so ties go to T2.
#include <algorithm>
#include <list>
#include <memory>
#include <unordered_map>
#include <vector>

#include "moe/replacement_policy.h"

namespace sharpi {

namespace {

class ArcPolicy final : public ReplacementPolicy {
  public:
    explicit ArcPolicy(uint64_t capacity) : c_(static_cast<double>(capacity)) {}

    const char* name() const override { return "arc"; }
    void insert(uint32_t slot, ExpertKey key) override {
        remove(slot);
        const uint64_t k = pack(key);
        auto ghost = ghosts_.find(k);
        List target = List::t1;
        if (ghost != ghosts_.end()) {
            const double b1 = static_cast<double>(b1_.size()), b2 = static_cast<double>(b2_.size());
            if (ghost->second.list == List::b1) {
                p_ = std::min(c_, p_ + std::max(1.0, b2 / b1));
                b1_.erase(ghost->second.at);
            } else {
                p_ = std::max(0.0, p_ - std::max(1.0, b1 / b2));
                b2_.erase(ghost->second.at);
            }
            ghosts_.erase(ghost);
            target = List::t2;
        }
        if (slot >= slots_.size()) slots_.resize(static_cast<size_t>(slot) + 1);
        slots_[slot].key = k;
        push(slot, target);
        trim_ghosts();
    }
    void touch(uint32_t slot) override {
        if (!contains(slot)) return;
        unlink(slot);
        push(slot, List::t2);
    }
    void remove(uint32_t slot) override {
        if (!contains(slot)) return;
        const List from = slots_[slot].list;
        unlink(slot);
        std::list<uint64_t>& ghost = from == List::t1 ? b1_ : b2_;
        ghost.push_front(slots_[slot].key);
        ghosts_[slots_[slot].key] = Ghost{from == List::t1 ? List::b1 : List::b2, ghost.begin()};
        trim_ghosts();
    }
    bool contains(uint32_t slot) const override {
        return slot < slots_.size() && slots_[slot].list != List::none;
    }
    size_t size() const override { return t1_.size() + t2_.size(); }
    uint32_t victim(const Evictable& evictable) override {
        const bool from_t1 = !t1_.empty() && static_cast<double>(t1_.size()) > p_;
        const std::list<uint32_t>* order[2] = {from_t1 ? &t1_ : &t2_, from_t1 ? &t2_ : &t1_};
        for (const std::list<uint32_t>* l : order) {
            for (auto it = l->rbegin(); it != l->rend(); ++it) {
                if (evictable(*it)) return *it;
            }
        }
        return kNone;
    }

  private:
    enum class List : uint8_t { none, t1, t2, b1, b2 };
    struct Slot {
        List list = List::none;
        uint64_t key = 0;
        std::list<uint32_t>::iterator at;
    };
    struct Ghost {
        List list;
        std::list<uint64_t>::iterator at;
    };

    static uint64_t pack(ExpertKey k) {
        return (static_cast<uint64_t>(static_cast<uint32_t>(k.layer)) << 32) |
               static_cast<uint32_t>(k.expert);
    }
    void push(uint32_t slot, List list) {
        std::list<uint32_t>& l = list == List::t1 ? t1_ : t2_;
        l.push_front(slot);
        slots_[slot].list = list;
        slots_[slot].at = l.begin();
    }
    void unlink(uint32_t slot) {
        Slot& s = slots_[slot];
        (s.list == List::t1 ? t1_ : t2_).erase(s.at);
        s.list = List::none;
    }
    void drop_oldest(std::list<uint64_t>& ghost) {
        ghosts_.erase(ghost.back());
        ghost.pop_back();
    }
    void trim_ghosts() {
        while (!b1_.empty() && static_cast<double>(t1_.size() + b1_.size()) > c_) drop_oldest(b1_);
        while (!b2_.empty() &&
               static_cast<double>(t1_.size() + t2_.size() + b1_.size() + b2_.size()) > 2 * c_)
            drop_oldest(b2_);
        while (!b1_.empty() &&
               static_cast<double>(t1_.size() + t2_.size() + b1_.size() + b2_.size()) > 2 * c_)
            drop_oldest(b1_);
    }

    const double c_;
    double p_ = 0.0;               // target size of T1
    std::list<uint32_t> t1_, t2_;  // cached slots, front = most recent
    std::list<uint64_t> b1_, b2_;  // ghost keys, front = most recently evicted
    std::vector<Slot> slots_;
    std::unordered_map<uint64_t, Ghost> ghosts_;
};

}  // namespace

std::unique_ptr<ReplacementPolicy> make_arc_policy(uint64_t capacity, const ReplacementPolicyOptions&) {
    return std::make_unique<ArcPolicy>(capacity);
}

}  // namespace sharpi
