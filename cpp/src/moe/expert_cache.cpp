#include "moe/expert_cache.h"

#include <algorithm>
#include <chrono>

#include "sharpi/errors.h"

namespace sharpi {

namespace {

using Clock = std::chrono::steady_clock;

// Offsets of the gate/up/down regions inside a slot (base[0..2]) and the slot size (base[3]). Each
// region fits the largest expert range of its part over all layers, padded so that its 4 KiB
// aligned superset fits (worst case for an unaligned range: one extra block at each end).
void slot_layout(const ExpertLayout& layout, uint64_t base[kExpertParts + 1]) {
    uint64_t at = 0;
    for (int part = 0; part < kExpertParts; ++part) {
        base[part] = at;
        uint64_t largest = 0;
        for (const ExpertLayerLayout& x : layout.layers) {
            if (x.present()) largest = std::max(largest, x.parts[part].bytes);
        }
        at += ExpertReader::align_up(largest) + ExpertReader::kAlignment;
    }
    base[kExpertParts] = at;
}

}  // namespace

uint64_t ExpertCache::slot_bytes(const ExpertLayout& layout) {
    uint64_t base[kExpertParts + 1];
    slot_layout(layout, base);
    return base[kExpertParts];
}

ExpertCache::ExpertCache(const ExpertLayout& layout, const ExpertCacheOptions& options)
    : ExpertCache(layout, options, ram_tier(layout.files, options.reader)) {}

ExpertCache::ExpertCache(const ExpertLayout& layout, const ExpertCacheOptions& options,
                         const ExpertTier& tier)
    : layout_(layout), n_expert_(layout.n_expert), tier_name_(tier.name), reader_note_(tier.reader_note) {
    const int64_t k = layout.n_expert_used;
    if (options.n_slots < static_cast<uint64_t>(k)) {
        throw InvalidArgument("[cache] " + std::to_string(options.n_slots) +
                              " expert slots cannot hold the " + std::to_string(k) +
                              " experts one token uses per layer");
    }
    if (!(options.probation > 0.0 && options.probation < 1.0)) {
        throw InvalidArgument("[cache] SLRU probation share must be in (0, 1), got " +
                              std::to_string(options.probation));
    }
    if (!(options.read_timeout_ms > 0.0)) {
        throw InvalidArgument("[cache] read timeout must be > 0 ms, got " +
                              std::to_string(options.read_timeout_ms));
    }
    n_cache_slots_ = options.n_slots;
    n_staging_ = options.n_staging;
    read_timeout_ms_ = options.read_timeout_ms;
    ReplacementPolicyOptions policy_options;
    policy_options.probation = options.probation;
    policy_options.prior = options.policy_prior;
    policy_options.n_layer = layout.n_layer();
    policy_options.n_expert = n_expert_;
    policy_ = make_replacement_policy(options.policy, n_cache_slots_, policy_options);
    uint64_t base[kExpertParts + 1];
    slot_layout(layout, base);
    std::copy(base, base + kExpertParts, part_base_);
    slot_bytes_ = base[kExpertParts];

    const uint64_t n_total = n_cache_slots_ + n_staging_;
    memory_ = tier.allocate(n_total * slot_bytes_);
    reader_ = tier.open_filler(memory_->data(), memory_->bytes());

    slots_.resize(n_total);
    for (uint64_t s = 0; s < n_total; ++s) {
        slots_[s].mem = memory_->data() + s * slot_bytes_;
        free_.push_back(static_cast<uint32_t>(n_total - 1 - s));  // pop_back hands out slot 0 first
    }
    where_.assign(static_cast<size_t>(layout.n_layer() * n_expert_), -1);
    layer_stats_.resize(static_cast<size_t>(layout.n_layer()));
    expert_accesses_.assign(where_.size(), 0);
    expert_misses_.assign(where_.size(), 0);
}

ExpertCache::~ExpertCache() {
    reader_.reset();  // waits for or cancels in-flight reads before the arena goes away
}

// ---------------------------------------------------------------------------------------------
// Reads and completions

void ExpertCache::issue_reads(uint32_t s, int il, int32_t e, ReadPriority priority) {
    Slot& slot = slots_[s];
    const ExpertLayerLayout& x = layout_.layers[static_cast<size_t>(il)];
    slot.state = State::loading;
    slot.layer = il;
    slot.expert = e;
    slot.failed = false;
    slot.dropped = false;
    slot.error.clear();
    slot.bytes = 0;
    slot.pending = 0;
    if (timeline_ && timeline_->enabled()) slot.issued_us = timeline_->now_us();
    where_[key(il, e)] = static_cast<int32_t>(s);
    for (int part = 0; part < kExpertParts; ++part) {
        const FileRange r = x.parts[part].range(e);
        if (r.bytes == 0) continue;  // an ungated layer's gate: nothing to read
        ReadRequest req;
        req.tag = tag(s, part);
        req.file = r.file;
        req.offset = r.offset;
        req.length = r.bytes;
        req.buffer = slot.mem + part_base_[part];
        req.priority = priority;
        try {
            reader_->submit(req);
        } catch (...) {
            // The parts already submitted are cancelled, or (started) left to finish and free the
            // slot in process(); nobody may find the half-read expert meanwhile.
            for (int p = 0; p < part; ++p) {
                if (x.parts[p].bytes > 0 && reader_->cancel(tag(s, p))) slot.pending--;
            }
            slot.dropped = true;
            where_[key(il, e)] = -1;
            if (slot.pending == 0) free_slot(s);
            throw;
        }
        slot.pending++;
        slot.bytes += r.bytes;
    }
}

void ExpertCache::process(const std::vector<ReadCompletion>& done) {
    for (const ReadCompletion& c : done) {
        const uint32_t s = static_cast<uint32_t>(c.tag / 4);
        const int part = static_cast<int>(c.tag % 4);
        Slot& slot = slots_[s];
        if (!c.ok && !slot.failed) {
            slot.failed = true;
            slot.error = c.error + " (tensor " + layout_.part(slot.layer, part).tensor + ", expert " +
                         std::to_string(slot.expert) + " " + expert_part_name(part) + ")";
        }
        if (--slot.pending > 0) continue;
        if (timeline_ && timeline_->enabled()) {
            timeline_->span("reader",
                            "L" + std::to_string(slot.layer) + " E" + std::to_string(slot.expert) +
                                (slot.staged ? " prefetch" : ""),
                            slot.issued_us, timeline_->now_us());
        }
        if (slot.failed || slot.dropped) {
            fail_if_needed(s);
        } else {
            slot.state = State::ready;
        }
    }
}

void ExpertCache::drain() {
    while (reader_->outstanding() > 0) {
        completions_.clear();
        reader_->reap(completions_, /*wait=*/true);
        process(completions_);
    }
}

void ExpertCache::poll() {
    completions_.clear();
    if (reader_->reap(completions_, /*wait=*/false) > 0) process(completions_);
}

// A slot whose reads have all finished but that failed or was dropped goes back to the free list
// once nothing pins it. A failed slot that is pinned stays until release() so wait() can report it.
void ExpertCache::fail_if_needed(uint32_t s) {
    Slot& slot = slots_[s];
    if (slot.pending > 0 || slot.pins > 0) return;
    if (slot.failed || slot.dropped) free_slot(s);
}

// ---------------------------------------------------------------------------------------------
// Slot bookkeeping (the order of eviction is the policy's)

void ExpertCache::unstage(uint32_t s) {
    if (!slots_[s].staged) return;
    slots_[s].staged = false;
    --n_staged_;
}

void ExpertCache::free_slot(uint32_t s) {
    Slot& slot = slots_[s];
    policy_->remove(s);
    unstage(s);
    if (slot.layer >= 0 && where_[key(slot.layer, slot.expert)] == static_cast<int32_t>(s)) {
        where_[key(slot.layer, slot.expert)] = -1;
    }
    slot.state = State::free;
    slot.layer = slot.expert = -1;
    slot.failed = slot.dropped = slot.ahead = false;
    free_.push_back(s);
}

void ExpertCache::evict(uint32_t s) {
    LayerExpertStats& ls = layer_stats_[static_cast<size_t>(slots_[s].layer)];
    ++ls.evictions;
    if (slots_[s].ahead) ls.prefetch_wasted_bytes += slots_[s].bytes;
    free_slot(s);
}

uint32_t ExpertCache::try_take_cache_slot() {
    if (policy_->size() < n_cache_slots_ && !free_.empty()) {
        const uint32_t s = free_.back();
        free_.pop_back();
        return s;
    }
    const uint32_t victim = policy_->victim([this](uint32_t s) {
        const Slot& slot = slots_[s];
        return slot.pins == 0 && slot.state == State::ready;
    });
    if (victim != ReplacementPolicy::kNone) {
        evict(victim);
        free_.pop_back();  // evict() pushed it
    }
    return victim;
}

uint32_t ExpertCache::take_cache_slot() {
    for (;;) {
        const uint32_t s = try_take_cache_slot();
        if (s != ReplacementPolicy::kNone) return s;
        // Every unpinned slot is still loading: wait for a read to finish rather than fail. This
        // happens at the minimum budget after a layer ended early (an IoError from wait() leaves
        // the layer's other reads in flight, unpinned).
        if (reader_->outstanding() == 0) break;
        completions_.clear();
        reader_->reap(completions_, /*wait=*/true);
        process(completions_);
    }
    // Only reachable if more experts are held at once than max_acquire() allows; callers acquire
    // in waves of max_acquire().
    throw Error("[cache] no evictable expert slot: all " + std::to_string(n_cache_slots_) +
                " slots are pinned or loading");
}

// ---------------------------------------------------------------------------------------------
// ExpertSource

void ExpertCache::view_of(uint32_t s, ExpertView* view) const {
    const Slot& slot = slots_[s];
    const ExpertLayerLayout& x = layout_.layers[static_cast<size_t>(slot.layer)];
    WeightView* out[kExpertParts] = {&view->gate, &view->up, &view->down};
    for (int part = 0; part < kExpertParts; ++part) {
        // The reader put the aligned superset at the region's start (io/expert_reader.h).
        const uint64_t skew = x.parts[part].range(slot.expert).offset % ExpertReader::kAlignment;
        *out[part] = x.parts[part].at(slot.mem + part_base_[part] + skew);
    }
    if (!x.gated()) view->gate = view->up;
}

void ExpertCache::acquire(int il, const int32_t* experts, int n, ExpertView* views) {
    if (static_cast<uint64_t>(n) > n_cache_slots_) {
        throw Error("[cache] acquire of " + std::to_string(n) + " experts exceeds the " +
                    std::to_string(n_cache_slots_) + " cache slots");
    }
    poll();
    current_.clear();
    current_layer_ = il;
    // Exception safety: a throw below (no evictable slot, a rejected read request, bad_alloc) must
    // not leave slots pinned or the reader plugged: the caller's lease (moe_ffn.cpp) only exists once
    // acquire returns, and at the minimum budget one leaked pin wedges every later layer.
    bool plugged = false;
    try {
        acquire_pinned(il, experts, n, &plugged);
    } catch (...) {
        for (uint32_t s : current_) {
            if (s == kNoSlot) continue;
            Slot& slot = slots_[s];
            if (slot.pins > 0) slot.pins--;
            fail_if_needed(s);
        }
        current_.clear();
        current_layer_ = -1;
        if (plugged) reader_->unplug();
        throw;
    }
    if (plugged) reader_->unplug();
    for (int i = 0; i < n; ++i) view_of(current_[static_cast<size_t>(i)], &views[i]);
}

// acquire() without the rollback: pins one slot per expert into current_ (kNoSlot until pinned).
void ExpertCache::acquire_pinned(int il, const int32_t* experts, int n, bool* plugged) {
    policy_->gate(il);
    LayerExpertStats& ls = layer_stats_[static_cast<size_t>(il)];
    // Pin the hits first, so that the misses' evictions can never pick an expert this layer needs.
    std::vector<int> missing;
    current_.assign(static_cast<size_t>(n), kNoSlot);
    for (int i = 0; i < n; ++i) {
        const uint32_t kk = key(il, experts[i]);
        ++ls.accesses;
        ++expert_accesses_[kk];
        const int32_t s = where_[kk];
        if (s < 0) {
            missing.push_back(i);
            continue;
        }
        Slot& slot = slots_[static_cast<uint32_t>(s)];
        slot.pins++;  // pinned before anything below can throw, so the rollback unpins it
        current_[static_cast<size_t>(i)] = static_cast<uint32_t>(s);
        ++ls.hits;
        if (slot.staged) {
            ++ls.prefetch_used;
            ++(slot.state == State::ready ? ls.prefetch_timely : ls.prefetch_late);
            // Adopt a prefetched expert: it joins the policy, evicting a victim if the cache is full.
            if (policy_->size() >= n_cache_slots_) free_.push_back(take_cache_slot());
            unstage(static_cast<uint32_t>(s));  // after the throw point: a failed adoption stays staged
            policy_->insert(static_cast<uint32_t>(s), ExpertKey{il, experts[i]});
        } else {
            policy_->touch(static_cast<uint32_t>(s));
        }
        if (slot.ahead) {
            slot.ahead = false;
            ++ls.prefetch_used;
            ++(slot.state == State::ready ? ls.prefetch_timely : ls.prefetch_late);
        }
        if (slot.state == State::loading) {
            const ExpertLayerLayout& x = layout_.layers[static_cast<size_t>(il)];
            for (int part = 0; part < kExpertParts; ++part) {
                if (x.parts[part].bytes > 0) reader_->promote(tag(static_cast<uint32_t>(s), part));
            }
        }
    }
    // Plugged: the layer's misses are all queued before the first starts, so they go out in one
    // batch ordered by priority.
    if (!missing.empty()) {
        reader_->plug();
        *plugged = true;
    }
    for (int i : missing) {
        const uint32_t kk = key(il, experts[i]);
        ++ls.misses;
        ++expert_misses_[kk];
        const uint32_t s = take_cache_slot();
        try {
            issue_reads(s, il, experts[i], ReadPriority::demand);
        } catch (...) {
            if (slots_[s].state == State::free && std::find(free_.begin(), free_.end(), s) == free_.end())
                free_.push_back(s);  // taken, never issued
            throw;
        }
        policy_->insert(s, ExpertKey{il, experts[i]});
        slots_[s].pins++;
        ls.bytes_read += slots_[s].bytes;
        current_[static_cast<size_t>(i)] = s;
    }
}

bool ExpertCache::ready(int i) {
    poll();
    return slots_[current_[static_cast<size_t>(i)]].state != State::loading;
}

void ExpertCache::wait(int i) {
    const uint32_t s = current_[static_cast<size_t>(i)];
    if (slots_[s].state == State::loading) {
        const auto t0 = Clock::now();
        while (slots_[s].state == State::loading && !slots_[s].failed) wait_for_reads(s);
        // A failed read may still have sibling reads in flight: wait them out so the slot can be freed.
        while (slots_[s].pending > 0) wait_for_reads(s);
        const double stalled_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        layer_stats_[static_cast<size_t>(current_layer_)].stall_ms += stalled_ms;
        if (timeline_ && timeline_->enabled()) {
            const double end = timeline_->now_us();
            timeline_->span(
                "stall", "wait L" + std::to_string(current_layer_) + " E" + std::to_string(slots_[s].expert),
                end - stalled_ms * 1e3, end);
        }
    }
    if (slots_[s].failed) throw IoError(slots_[s].error);
}

void ExpertCache::wait_for_reads(uint32_t s) {
    completions_.clear();
    if (reader_->reap_for(completions_, read_timeout_ms_) == 0 && reader_->outstanding() > 0) {
        // The slot stays loading: its reads may still land, and only then can it be reused.
        const Slot& slot = slots_[s];
        const FileRange r = layout_.layers[static_cast<size_t>(slot.layer)].parts[0].range(slot.expert);
        throw IoError("[io] " + layout_.files[r.file] + ": expert " + std::to_string(slot.expert) +
                      " of layer " + std::to_string(slot.layer) + ": no read completed within " +
                      std::to_string(static_cast<int64_t>(read_timeout_ms_)) +
                      " ms (stalled device? SHARPI_READ_TIMEOUT_MS sets the limit)");
    }
    process(completions_);
}

void ExpertCache::release(int il) {
    for (uint32_t s : current_) {
        Slot& slot = slots_[s];
        if (slot.pins > 0) slot.pins--;
        if (slot.failed && slot.pending == 0 && slot.pins == 0) free_slot(s);
    }
    current_.clear();
    current_layer_ = -1;
}

// ---------------------------------------------------------------------------------------------
// Prefetch

ExpertCache::PrefetchOutcome ExpertCache::prefetch(int il, int32_t e) {
    if (where_[key(il, e)] >= 0) return PrefetchOutcome::present;
    if (n_staged_ >= n_staging_) return PrefetchOutcome::no_slot;
    poll();
    // Staging slots come from the free list only; with the cache full there is always room, since
    // the policy holds at most n_cache_slots and staging at most n_staging.
    if (free_.empty()) return PrefetchOutcome::no_slot;
    const uint32_t s = free_.back();
    free_.pop_back();
    issue_reads(s, il, e, ReadPriority::prefetch);
    slots_[s].staged = true;
    ++n_staged_;
    LayerExpertStats& ls = layer_stats_[static_cast<size_t>(il)];
    ++ls.prefetch_issued;
    ls.bytes_read += slots_[s].bytes;
    return PrefetchOutcome::issued;
}

void ExpertCache::read_ahead(int il, const int32_t* experts, int n) {
    poll();
    LayerExpertStats& ls = layer_stats_[static_cast<size_t>(il)];
    reader_->plug();
    for (int i = 0; i < n; ++i) {
        if (where_[key(il, experts[i])] >= 0) continue;
        const uint32_t s = try_take_cache_slot();
        if (s == ReplacementPolicy::kNone) break;
        issue_reads(s, il, experts[i], ReadPriority::prefetch);
        policy_->insert(s, ExpertKey{il, experts[i]});
        slots_[s].ahead = true;
        ++ls.prefetch_issued;
        ls.bytes_read += slots_[s].bytes;
    }
    reader_->unplug();
}

void ExpertCache::hint(int il, int32_t e) {
    const int32_t s = where_[key(il, e)];
    if (s >= 0 && !slots_[static_cast<uint32_t>(s)].staged) policy_->protect(static_cast<uint32_t>(s), il);
}

void ExpertCache::drop_unselected(int il, const int32_t* selected, int n) {
    const ExpertLayerLayout& x = layout_.layers[static_cast<size_t>(il)];
    for (uint32_t s = 0; s < slots_.size(); ++s) {
        Slot& slot = slots_[s];
        if (!slot.staged || slot.layer != il || slot.dropped) continue;
        if (std::find(selected, selected + n, slot.expert) != selected + n) continue;
        // Wasted: what was (or is being) read for nothing; cancelled parts never cost bytes.
        uint64_t wasted = slot.bytes;
        if (slot.state == State::loading) {
            for (int part = 0; part < kExpertParts; ++part) {
                if (x.parts[part].bytes > 0 && reader_->cancel(tag(s, part))) {
                    slot.pending--;
                    wasted -= x.parts[part].bytes;
                }
            }
            layer_stats_[static_cast<size_t>(il)].bytes_read -= slot.bytes - wasted;
            slot.dropped = true;
            // Nobody may find (and adopt) it any more; it stays counted as staging, so the
            // prefetcher cannot overcommit, until its reads in flight finish and process() frees it.
            where_[key(il, slot.expert)] = -1;
            if (slot.pending == 0) free_slot(s);
        } else {
            free_slot(s);
        }
        layer_stats_[static_cast<size_t>(il)].prefetch_wasted_bytes += wasted;
    }
}

// ---------------------------------------------------------------------------------------------
// Stats

ExpertCacheStats ExpertCache::stats() const {
    ExpertCacheStats st;
    st.tier = tier_name_;
    st.reader = reader_->name();
    st.reader_detail = reader_->describe();
    st.reader_note = reader_note_;
    st.n_slots = n_cache_slots_;
    st.n_staging = n_staging_;
    st.slot_bytes = slot_bytes_;
    st.layers = layer_stats_;
    st.expert_accesses = expert_accesses_;
    st.expert_misses = expert_misses_;
    st.io_busy_ms = reader_->busy_ms() - busy_ms_at_reset_;
    return st;
}

void ExpertCache::reset_stats() {
    std::fill(layer_stats_.begin(), layer_stats_.end(), LayerExpertStats{});
    std::fill(expert_accesses_.begin(), expert_accesses_.end(), 0);
    std::fill(expert_misses_.begin(), expert_misses_.end(), 0);
    busy_ms_at_reset_ = reader_->busy_ms();
}

}  // namespace sharpi
