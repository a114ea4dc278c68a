// The sequences an engine holds at once (continuous batching; docs/serving.md). Each has its own KV
// cache of n_ctx positions (pages faulted in only as positions fill, freed when it is removed), its
// DeltaNet state (hybrid archs), its position, and its tokens' expert selections (the predictor's
// history). The RAM budget charged n_seq caches when the session opened (placement.h), so at most
// n_seq sequences exist at once; sequence 0 always exists and is the single-sequence API's.
//
// Ids are handles that never alias: id = generation * n_seq + slot, and a slot's generation grows
// each time the slot is reused, so a host that kept a removed sequence's id gets InvalidArgument
// rather than someone else's sequence. cancel() works on ids without a lock (see below).
//
// Decode thread only, except request_cancel(), which any thread or a signal handler may call.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "model/kv_cache.h"
#include "model/recurrent_state.h"
#include "sharpi/types.h"

namespace sharpi {

struct Sequence {
    int32_t id = 0;
    std::unique_ptr<KvCache> kv;  // nullptr on the device path (the device keeps its own)
    std::unique_ptr<RecurrentState> recurrent;
    int64_t n_past = 0;
    // With a prefetcher: the experts of every token, [n_past, n_layer * top_k] (-1 where a layer has
    // no routing), so the predictor's history can be handed over again (after a truncate(), a failed
    // token, or when another sequence used the predictor in between).
    std::vector<int32_t> selections;
    // With a prefetcher: the kept tokens [n_past] beside `selections` (-1 where unknown), whose
    // echo guesses (predict/echo_guess.h) stage a step's first MoE layers and price draft lengths.
    std::vector<token_t> tokens;
    // The predictor's history must be rebuilt from `selections` before its next token.
    bool replay_history = false;
    // With an MTP head (SessionOptions::mtp): its KV cache (row p: the pair of position p's hidden
    // and token p + 1) and the trunk's output-normed hidden row of every position [n_ctx, n_embd].
    std::unique_ptr<KvCache> mtp_kv;
    std::unique_ptr<float[]> mtp_hidden;
};

class SequenceTable {
  public:
    using Factory = std::function<std::unique_ptr<Sequence>()>;
    // n_max >= 1 slots; makes sequence 0 with `make`.
    SequenceTable(int n_max, Factory make);

    int capacity() const { return static_cast<int>(slots_.size()); }
    // The sequence with this id; InvalidArgument naming the live ids when there is none.
    Sequence& at(int32_t id);
    const Sequence& at(int32_t id) const;
    // A new empty sequence; InvalidArgument when n_seq sequences exist.
    Sequence& add();
    // Drops a sequence and frees its cache (InvalidArgument for 0 or an unknown id).
    void remove(int32_t id);
    std::vector<int32_t> ids() const;

    // Asks that the tokens of sequence `id` in the running (or next) step that holds it are not
    // appended. Lock-free; an unknown or stale id is ignored.
    void request_cancel(int32_t id) noexcept;
    // Whether a cancel of `id` is pending; consume_cancel also clears it.
    bool cancel_pending(int32_t id) const noexcept;
    bool consume_cancel(int32_t id) noexcept;

  private:
    int slot_of(int32_t id) const { return id % capacity(); }

    Factory make_;
    std::vector<std::unique_ptr<Sequence>> slots_;
    std::vector<int32_t> generation_;
    // The id whose cancel is pending in each slot, -1 for none (compared with the live id, so a
    // request for a removed sequence never reaches the slot's next one).
    std::unique_ptr<std::atomic<int32_t>[]> cancel_;
};

}  // namespace sharpi
