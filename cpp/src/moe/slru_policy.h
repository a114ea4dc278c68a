// SlruPolicy: segmented LRU (DESIGN §4). Two recency lists: a new entry enters probation's hot
// end; a second use moves it to protected's hot end, whose overflow (beyond capacity * (1 -
// probation) slots) is demoted back to probation's hot end, so it gets one more chance there.
// Victims come from probation's cold end, else protected's, skipping slots the caller may not
// evict. With probation = 1 there is no protected segment and this is plain LRU.
#pragma once

#include <cstdint>
#include <list>
#include <vector>

#include "moe/replacement_policy.h"

namespace sharpi {

class SlruPolicy final : public ReplacementPolicy {
  public:
    // Throws InvalidArgument unless 0 < probation <= 1.
    SlruPolicy(uint64_t capacity, double probation);

    const char* name() const override { return "slru"; }
    void insert(uint32_t slot) override;
    void touch(uint32_t slot) override;
    void remove(uint32_t slot) override;
    bool contains(uint32_t slot) const override { return segment_of(slot) != Segment::none; }
    size_t size() const override { return probation_.size() + protected_.size(); }
    uint32_t victim(const Evictable& evictable) const override;

  private:
    enum class Segment : uint8_t { none, probation, protected_ };
    struct Entry {
        Segment segment = Segment::none;
        std::list<uint32_t>::iterator at;  // position in its segment's list
    };
    Segment segment_of(uint32_t slot) const {
        return slot < entries_.size() ? entries_[slot].segment : Segment::none;
    }
    Entry& entry(uint32_t slot);
    void push_probation(uint32_t slot);

    uint64_t n_protected_max_ = 0;
    std::list<uint32_t> probation_, protected_;  // front = most recently used
    std::vector<Entry> entries_;                 // by slot id, grown on demand
};

}  // namespace sharpi
