#include "moe/slru_policy.h"

#include <cmath>
#include <string>

#include "sharpi/errors.h"

namespace sharpi {

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

void SlruPolicy::insert(uint32_t slot) {
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

uint32_t SlruPolicy::victim(const Evictable& evictable) const {
    for (const std::list<uint32_t>* segment : {&probation_, &protected_}) {
        for (auto it = segment->rbegin(); it != segment->rend(); ++it) {
            if (evictable(*it)) return *it;
        }
    }
    return kNone;
}

}  // namespace sharpi
