// SlruPolicy: segmented LRU (docs/design.md §4). Two recency lists: a new entry enters probation's hot
// end; a second use moves it to protected's hot end, whose overflow (beyond capacity * (1 -
// probation) slots) is demoted back to probation's hot end, so it gets one more chance there.
// Victims come from probation's cold end, else protected's, skipping slots the caller may not
// evict. With probation = 1 there is no protected segment and this is plain LRU.
#include <cmath>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "moe/replacement_policy.h"
#include "sharpi/errors.h"

namespace sharpi {

namespace {

class SlruPolicy final : public ReplacementPolicy {
  public:
    // Throws InvalidArgument unless 0 < probation <= 1.
    SlruPolicy(uint64_t capacity, double probation);

    const char* name() const override { return "slru"; }
    void insert(uint32_t slot, ExpertKey key) override;
    void touch(uint32_t slot) override;
    void remove(uint32_t slot) override;
    bool contains(uint32_t slot) const override { return segment_of(slot) != Segment::none; }
    size_t size() const override { return probation_.size() + protected_.size(); }
    uint32_t victim(const Evictable& evictable) override;

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

SlruPolicy::SlruPolicy(uint64_t capacity, double probation) {
    if (!(probation > 0.0 && probation <= 1.0)) {
        throw InvalidArgument("[cache] SLRU probation share must be in (0, 1], got " +
                              std::to_string(probation));
    }
    n_protected_max_ = static_cast<uint64_t>(std::floor(static_cast<double>(capacity) * (1.0 - probation)));
}

SlruPolicy::Entry& SlruPolicy::entry(uint32_t slot) {
    if (slot >= entries_.size()) entries_.resize(static_cast<size_t>(slot) + 1);
    return entries_[slot];
}

void SlruPolicy::push_probation(uint32_t slot) {
    probation_.push_front(slot);
    Entry& e = entry(slot);
    e.at = probation_.begin();
    e.segment = Segment::probation;
}

void SlruPolicy::insert(uint32_t slot, ExpertKey) {
    remove(slot);
    push_probation(slot);
}

void SlruPolicy::remove(uint32_t slot) {
    switch (segment_of(slot)) {
        case Segment::probation:
            probation_.erase(entries_[slot].at);
            break;
        case Segment::protected_:
            protected_.erase(entries_[slot].at);
            break;
        case Segment::none:
            return;
    }
    entries_[slot].segment = Segment::none;
}

void SlruPolicy::touch(uint32_t slot) {
    remove(slot);
    protected_.push_front(slot);
    Entry& e = entry(slot);
    e.at = protected_.begin();
    e.segment = Segment::protected_;
    // Protected overflow goes back to probation's hot end (it gets one more chance there).
    while (protected_.size() > n_protected_max_) {
        const uint32_t demoted = protected_.back();
        protected_.pop_back();
        entries_[demoted].segment = Segment::none;
        push_probation(demoted);
    }
}

uint32_t SlruPolicy::victim(const Evictable& evictable) {
    for (const std::list<uint32_t>* segment : {&probation_, &protected_}) {
        for (auto it = segment->rbegin(); it != segment->rend(); ++it) {
            if (evictable(*it)) return *it;
        }
    }
    return kNone;
}

}  // namespace

std::unique_ptr<ReplacementPolicy> make_slru_policy(uint64_t capacity,
                                                    const ReplacementPolicyOptions& options) {
    return std::make_unique<SlruPolicy>(capacity, options.probation);
}

}  // namespace sharpi
