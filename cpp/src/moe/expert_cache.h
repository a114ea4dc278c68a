// ExpertCache: routed experts streamed from the model file into a fixed pool of equal-size RAM
// slots under a byte budget (docs/design.md §4). It is the ExpertSource of a streaming session.
//
// Owns: the slot arena (one anonymous mapping, 4 KiB-aligned, pages touched only when filled), the
// reader (io_uring or pread, which reads straight into slot memory), the replacement policy (which
// slot to evict; moe/replacement_policy.h) and all slot bookkeeping. It knows the model only as an
// ExpertLayout (file ranges and matrix shapes), never Model or GGUF objects. Called only from the
// decode thread (acquire / ready / wait / release by the MoE FFN, prefetch / present by the
// prefetcher); the reader completes reads asynchronously and the cache learns of them only through
// reap(), so no locks are needed. It must never block except in wait(), and never evict for a
// prefetch (the one exception is a prompt's read-ahead, read_ahead(): see there why).
//
// A slot holds one expert of one layer: its gate, up and down byte ranges, kept quantized exactly
// as in the file. Slot states: free -> loading -> ready, with a pin count while a layer computes.
// Invariants:
// - A slot that is loading is never evicted or reused (the kernel or a reader thread is writing
//   into it); a pinned slot is never evicted.
// - An expert is in at most one slot; a demand for an expert already loading waits on that read
//   (and raises it to demand priority) and never issues a second one.
// - Prefetch never evicts: prefetched experts land in a separate staging pool, outside the
//   replacement policy. (Prefill read-ahead is not a prefetch: it fills cache slots and may evict
//   unpinned ready ones, never a pinned or loading slot.) When the gate selects a staged expert it is adopted
//   into the policy (evicting a victim then). A staged expert the gate did not select is dropped: it leaves
//   the expert map at once (it can never be adopted) and its slot is freed when its reads in flight finish.
// - The policy holds exactly the adopted or demand-filled slots (at most n_slots of them).
// - The policy sees the calls moe/policy_replay.h replays offline, in the same order: gate(il) at
//   each acquire, touch for hits, victim/remove/insert for misses, protect for the prefetcher's
//   hints (hint()) on cached experts. So without prefetch, offline misses equal the engine's.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "io/expert_reader.h"
#include "moe/expert_layout.h"
#include "moe/expert_source.h"
#include "moe/expert_tier.h"
#include "moe/replacement_policy.h"
#include "sharpi/types.h"
#include "trace/timeline.h"

namespace sharpi {

struct ExpertCacheOptions {
    uint64_t n_slots = 0;                               // cache slots, held by the policy (>= n_expert_used)
    uint64_t n_staging = 0;                             // prefetch staging slots (0: no prefetch)
    std::string policy = default_replacement_policy();  // replacement policy (make_replacement_policy)
    double probation = 0.25;                            // SLRU: share of n_slots in probation, in (0, 1)
    std::vector<float> policy_prior;  // "prior": [n_layer * n_expert] (gguf/cache_prior_file.h)
    std::string reader = "auto";
    // wait() raises IoError when no read completes for this long (a stalled device); > 0.
    double read_timeout_ms = 60000.0;
};

class ExpertCache final : public ExpertSource {
  public:
    // `layout` must outlive the cache. Its reader opens every file of layout.files (the shards of a
    // split model) and reads each expert from the file its part names. Throws InvalidArgument (too
    // few slots, bad policy option), IoError (the reader cannot open a file).
    ExpertCache(const ExpertLayout& layout, const ExpertCacheOptions& options);
    // The same cache in another tier (moe/expert_tier.h): its arena from tier.allocate, its slots
    // filled by tier.open_filler's reader. options.reader is ignored (the tier names its filler).
    ExpertCache(const ExpertLayout& layout, const ExpertCacheOptions& options, const ExpertTier& tier);
    ~ExpertCache() override;

    // Bytes of one slot for this model: the largest expert's three ranges, each padded so that its
    // 4 KiB-aligned superset fits.
    static uint64_t slot_bytes(const ExpertLayout& layout);

    void acquire(int il, const int32_t* experts, int n, ExpertView* views) override;
    bool ready(int i) override;
    void wait(int i) override;
    void release(int il) override;
    int max_acquire() const override { return static_cast<int>(n_cache_slots_); }

    enum class PrefetchOutcome { issued, present, no_slot };
    // Starts reading expert e of layer il into a staging slot, unless it is cached or loading
    // (present) or no staging slot is free (no_slot; prefetch never evicts).
    PrefetchOutcome prefetch(int il, int32_t e);
    // Staging slots a prefetch() could take now.
    uint64_t free_staging_slots() const { return n_staging_ - n_staged_; }
    // Whether expert e of layer il is cached or loading.
    bool present(int il, int32_t e) const { return where_[key(il, e)] >= 0; }
    // Requested bytes of one expert of layer il (its three ranges).
    uint64_t expert_bytes(int il) const { return layout_.expert_bytes(il); }
    // The reader's load (ExpertReader::inflight_bytes / bytes_per_ms), for the prefetcher's
    // timeliness test.
    const ExpertReader& reader() const { return *reader_; }
    // Gate of layer il fired with `selected`: staged experts of il it did not pick are dropped
    // (queued reads cancelled; their bytes counted as wasted).
    void drop_unselected(int il, const int32_t* selected, int n);
    void gate_fired(int il, const int32_t* selected, int n) override { drop_unselected(il, selected, n); }
    // Prefill read-ahead (ExpertSource::read_ahead): reads the experts of layer il not yet present
    // into cache slots, at prefetch priority, evicting the policy's victims among unpinned ready
    // slots only, and stops when there is none (it never waits and never evicts what a layer holds
    // or what is loading). Unlike prefetch() it does evict: in a prompt, every layer's experts are
    // needed once and the earlier layers' ones not again until decoding starts. Counted as
    // prefetch_issued; prefetch_used when acquired, prefetch_wasted_bytes when evicted unused.
    void read_ahead(int il, const int32_t* experts, int n) override;
    // The predictor expects expert e of layer il to be needed at il's gate (a hint the prefetcher
    // passes on): if it is cached, the policy may protect it until then (ReplacementPolicy::protect).
    void hint(int il, int32_t e);

    // Waits until every fill in flight has completed and been processed (tests compare tiers after it;
    // never called on the decode path).
    void drain();

    ExpertCacheStats stats() const;
    void reset_stats();
    const char* reader_name() const { return reader_->name(); }
    const std::string& tier_name() const { return tier_name_; }
    // Slot memory of index i of the last acquire (valid until release) and the filler's tag of its
    // part (gate, up, down): how a device tier finds the copy events compute must wait on.
    const uint8_t* slot_memory(int i) const { return slots_[current_[static_cast<size_t>(i)]].mem; }
    uint64_t fill_tag(int i, int part) const { return tag(current_[static_cast<size_t>(i)], part); }
    void set_timeline(Timeline* timeline) { timeline_ = timeline; }

  private:
    enum class State { free, loading, ready };

    struct Slot {
        uint8_t* mem = nullptr;
        State state = State::free;
        bool staged = false;  // in the staging pool (a prefetch not yet adopted), not in the policy
        int32_t layer = -1, expert = -1;
        int pins = 0;
        int pending = 0;       // reads not yet completed
        bool failed = false;   // a read failed: the slot is freed once unpinned and idle
        bool dropped = false;  // staged and unselected: freed as soon as its reads finish
        bool ahead = false;    // read ahead (read_ahead()) and not acquired since
        std::string error;
        uint64_t bytes = 0;    // requested bytes of this expert
        double issued_us = 0;  // timeline: when its reads were submitted
    };

    uint32_t key(int il, int32_t e) const { return static_cast<uint32_t>(il * n_expert_ + e); }
    uint64_t tag(uint32_t slot, int part) const { return uint64_t{slot} * 4 + static_cast<uint64_t>(part); }
    void issue_reads(uint32_t s, int il, int32_t e, ReadPriority priority);
    void acquire_pinned(int il, const int32_t* experts, int n, bool* plugged);
    static constexpr uint32_t kNoSlot = ~uint32_t{0};  // current_ entry not pinned (yet)
    void view_of(uint32_t s, ExpertView* view) const;
    uint32_t take_cache_slot();      // a free slot, evicting the policy's victim if the cache is full
    uint32_t try_take_cache_slot();  // the same, or ReplacementPolicy::kNone when nothing is evictable
    void evict(uint32_t s);
    void free_slot(uint32_t s);
    void unstage(uint32_t s);
    void process(const std::vector<ReadCompletion>& done);
    void poll();
    // Blocks until at least one read completes and processes it; IoError naming slot s (the one
    // compute waits for) when none completes within the read timeout.
    void wait_for_reads(uint32_t s);
    void fail_if_needed(uint32_t s);

    const ExpertLayout& layout_;
    int64_t n_expert_ = 0;
    uint64_t n_cache_slots_ = 0, n_staging_ = 0;
    uint64_t slot_bytes_ = 0;
    double read_timeout_ms_ = 0.0;
    uint64_t part_base_[kExpertParts] = {0, 0, 0};  // offsets of the gate/up/down regions inside a slot
    std::string tier_name_;
    std::string reader_note_;               // ExpertTier::reader_note
    std::unique_ptr<SlotMemory> memory_;    // the slot arena
    std::unique_ptr<ExpertReader> reader_;  // the tier's filler, declared after the arena: destroyed first
    std::unique_ptr<ReplacementPolicy> policy_;

    std::vector<Slot> slots_;
    std::vector<int32_t> where_;  // key -> slot or -1
    std::vector<uint32_t> free_;
    uint64_t n_staged_ = 0;
    std::vector<uint32_t> current_;  // slots of the last acquire, by index
    int current_layer_ = -1;
    std::vector<ReadCompletion> completions_;

    double busy_ms_at_reset_ = 0.0;  // reader_->busy_ms() at reset_stats (io_busy_ms counts from there)

    Timeline* timeline_ = nullptr;
    std::vector<LayerExpertStats> layer_stats_;
    std::vector<uint64_t> expert_accesses_, expert_misses_;
};

}  // namespace sharpi
