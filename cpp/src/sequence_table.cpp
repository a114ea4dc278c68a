#include "sequence_table.h"

#include <string>

#include "sharpi/errors.h"

namespace sharpi {

static_assert(std::atomic<int32_t>::is_always_lock_free, "request_cancel() must be async-signal-safe");

SequenceTable::SequenceTable(int n_max, Factory make)
    : make_(std::move(make)),
      slots_(static_cast<size_t>(n_max)),
      generation_(static_cast<size_t>(n_max), 0),
      cancel_(new std::atomic<int32_t>[static_cast<size_t>(n_max)]) {
    for (int i = 0; i < n_max; ++i) cancel_[i].store(-1, std::memory_order_relaxed);
    slots_[0] = make_();
    slots_[0]->id = 0;
}

const Sequence& SequenceTable::at(int32_t id) const {
    if (id >= 0) {
        const auto& s = slots_[static_cast<size_t>(slot_of(id))];
        if (s && s->id == id) return *s;
    }
    std::string live;
    for (int32_t i : ids()) live += (live.empty() ? "" : ", ") + std::to_string(i);
    throw InvalidArgument("sequence " + std::to_string(id) + " does not exist (the session holds " + live +
                          ")");
}

Sequence& SequenceTable::at(int32_t id) {
    return const_cast<Sequence&>(static_cast<const SequenceTable&>(*this).at(id));
}

Sequence& SequenceTable::add() {
    for (size_t slot = 0; slot < slots_.size(); ++slot) {
        if (slots_[slot]) continue;
        auto s = make_();
        ++generation_[slot];
        s->id = static_cast<int32_t>(generation_[slot] * static_cast<int64_t>(slots_.size()) +
                                     static_cast<int64_t>(slot));
        cancel_[slot].store(-1, std::memory_order_relaxed);
        slots_[slot] = std::move(s);
        return *slots_[slot];
    }
    throw InvalidArgument("add_sequence: the session already holds " + std::to_string(slots_.size()) +
                          " sequences, its n_seq (open it with a larger n_seq, or remove one)");
}

void SequenceTable::remove(int32_t id) {
    if (id == 0)
        throw InvalidArgument("remove_sequence: sequence 0 is the session's own and cannot be removed");
    at(id);  // InvalidArgument for an unknown id
    const size_t slot = static_cast<size_t>(slot_of(id));
    slots_[slot].reset();
    cancel_[slot].store(-1, std::memory_order_relaxed);
}

std::vector<int32_t> SequenceTable::ids() const {
    std::vector<int32_t> out;
    for (const auto& s : slots_) {
        if (s) out.push_back(s->id);
    }
    return out;
}

void SequenceTable::request_cancel(int32_t id) noexcept {
    if (id < 0) return;
    cancel_[slot_of(id)].store(id, std::memory_order_relaxed);
}

bool SequenceTable::cancel_pending(int32_t id) const noexcept {
    return id >= 0 && cancel_[slot_of(id)].load(std::memory_order_relaxed) == id;
}

bool SequenceTable::consume_cancel(int32_t id) noexcept {
    int32_t expected = id;
    return id >= 0 && cancel_[slot_of(id)].compare_exchange_strong(expected, -1, std::memory_order_relaxed);
}

}  // namespace sharpi
