// S3FifoPolicy: S3-FIFO (Yang et al., SOSP 2023). Three FIFO queues: a small one S (a share of
// the capacity) that every new expert enters, a main one M, and a ghost G of experts recently
// evicted from S (keys only, at most `capacity` of them). Each cached slot has a use count capped
// at 3. An expert found in G enters M directly. Eviction: while S holds its share or more (or M is
// empty), S's oldest entry leaves, to M if it was used since it entered, else out (its key to G);
// otherwise M's oldest leaves if unused, else its count drops by one and it goes round again.
//
// victim() performs those moves to M and round the queue (they change no slot's membership) and
// returns the first entry that would leave, skipping slots the caller may not evict (they stay
// where they are). With every candidate pinned it gives up after a bounded number of moves.
#include <algorithm>
#include <cmath>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "moe/replacement_policy.h"
#include "sharpi/errors.h"

namespace sharpi {

namespace {

class S3FifoPolicy final : public ReplacementPolicy {
  public:
    S3FifoPolicy(uint64_t capacity, double small_share)
        : capacity_(capacity),
          small_max_(std::max<uint64_t>(
              1, static_cast<uint64_t>(std::floor(static_cast<double>(capacity) * small_share)))) {}

    const char* name() const override { return "s3fifo"; }
    void insert(uint32_t slot, ExpertKey key) override {
        remove(slot);
        if (slot >= slots_.size()) slots_.resize(static_cast<size_t>(slot) + 1);
        Slot& s = slots_[slot];
        s.key = pack(key);
        s.freq = 0;
        auto ghost = ghost_at_.find(s.key);
        if (ghost != ghost_at_.end()) {
            ghost_.erase(ghost->second);
            ghost_at_.erase(ghost);
            push(slot, Queue::main);
        } else {
            push(slot, Queue::small);
        }
    }
    void touch(uint32_t slot) override {
        if (contains(slot)) slots_[slot].freq = std::min(slots_[slot].freq + 1, 3);
    }
    void remove(uint32_t slot) override {
        if (!contains(slot)) return;
        const Queue from = slots_[slot].queue;
        unlink(slot);
        if (from == Queue::small) {
            ghost_.push_front(slots_[slot].key);
            ghost_at_[slots_[slot].key] = ghost_.begin();
            while (ghost_.size() > capacity_) {
                ghost_at_.erase(ghost_.back());
                ghost_.pop_back();
            }
        }
    }
    bool contains(uint32_t slot) const override {
        return slot < slots_.size() && slots_[slot].queue != Queue::none;
    }
    size_t size() const override { return small_.size() + main_.size(); }
    uint32_t victim(const Evictable& evictable) override {
        // Each round either returns, moves an entry S -> M (at most |S| times) or lowers a count in
        // M (at most 3 per entry); pinned entries are skipped in place. So 4 * size + 1 rounds
        // suffice unless everything left is pinned.
        for (size_t rounds = 4 * size() + 1; rounds > 0; --rounds) {
            if (!small_.empty() && (small_.size() >= small_max_ || main_.empty())) {
                const uint32_t s = oldest_unpinned(small_, evictable);
                if (s != kNone) {
                    if (slots_[s].freq == 0) return s;
                    unlink(s);
                    slots_[s].freq = 0;
                    push(s, Queue::main);
                    continue;
                }
            }
            const uint32_t m = oldest_unpinned(main_, evictable);
            if (m == kNone) {
                // Everything in M is pinned: take from S whatever its size.
                const uint32_t s = oldest_unpinned(small_, evictable);
                if (s == kNone) return kNone;
                if (slots_[s].freq == 0) return s;
                unlink(s);
                slots_[s].freq = 0;
                push(s, Queue::main);
                continue;
            }
            if (slots_[m].freq == 0) return m;
            slots_[m].freq--;
            unlink(m);
            push(m, Queue::main);
        }
        for (const std::list<uint32_t>* q : {&small_, &main_}) {
            for (auto it = q->rbegin(); it != q->rend(); ++it) {
                if (evictable(*it)) return *it;
            }
        }
        return kNone;
    }

  private:
    enum class Queue : uint8_t { none, small, main };
    struct Slot {
        Queue queue = Queue::none;
        int freq = 0;
        uint64_t key = 0;
        std::list<uint32_t>::iterator at;
    };

    static uint64_t pack(ExpertKey k) {
        return (static_cast<uint64_t>(static_cast<uint32_t>(k.layer)) << 32) |
               static_cast<uint32_t>(k.expert);
    }
    static uint32_t oldest_unpinned(const std::list<uint32_t>& q, const Evictable& evictable) {
        for (auto it = q.rbegin(); it != q.rend(); ++it) {
            if (evictable(*it)) return *it;
        }
        return kNone;
    }
    void push(uint32_t slot, Queue queue) {
        std::list<uint32_t>& q = queue == Queue::small ? small_ : main_;
        q.push_front(slot);
        slots_[slot].queue = queue;
        slots_[slot].at = q.begin();
    }
    void unlink(uint32_t slot) {
        Slot& s = slots_[slot];
        (s.queue == Queue::small ? small_ : main_).erase(s.at);
        s.queue = Queue::none;
    }

    const uint64_t capacity_, small_max_;
    std::list<uint32_t> small_, main_;  // front = newest
    std::list<uint64_t> ghost_;         // keys evicted from S, front = newest
    std::unordered_map<uint64_t, std::list<uint64_t>::iterator> ghost_at_;
    std::vector<Slot> slots_;
};

}  // namespace

std::unique_ptr<ReplacementPolicy> make_s3fifo_policy(uint64_t capacity,
                                                      const ReplacementPolicyOptions& options) {
    if (!(options.s3fifo_small > 0.0 && options.s3fifo_small < 1.0)) {
        throw InvalidArgument("[cache] S3-FIFO small-queue share must be in (0, 1), got " +
                              std::to_string(options.s3fifo_small));
    }
    return std::make_unique<S3FifoPolicy>(capacity, options.s3fifo_small);
}

}  // namespace sharpi
