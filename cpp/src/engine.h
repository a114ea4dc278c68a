// The engine behind sharpi::Session: owns the model, the sequences (each with its KV cache:
// sequence_table.h), the thread pool, the expert source (resident, or the streaming ExpertCache),
// the prefetcher and the scratch arena, and runs the decode loop: embed, every layer, output head
// (model/forward.h), in chunks of kMaxBatch tokens. A step (decode_batch) may hold tokens of several
// sequences: the dense matmuls and the MoE FFN run once on the whole step, so each expert is read
// and multiplied once for every token of every sequence that routed to it; attention runs per
// sequence. It orchestrates and never calls a kernel. It is the GateObserver of the MoE FFN and
// hands every gate event to the prefetcher (the layer code never sees the prefetcher).
//
// Single-threaded API: one caller at a time drives decode(); parallelism is inside (the pool).
// The exceptions are cancel() and cancel_sequence(), callable from any thread or a signal handler
// while decode() runs. Failure atomicity: decode() validates everything before it touches state,
// and advances a sequence's n_past only after the whole step succeeded, so an exception
// (CancelledError included) leaves every sequence usable at its old position (positions beyond
// n_past in a KV cache are never read).
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda_interface.h"
#include "model/kv_cache.h"
#include "model/model.h"
#include "model/mtp.h"
#include "model/recurrent_state.h"
#include "moe/expert_cache.h"
#include "moe/expert_source.h"
#include "moe/moe_ffn.h"
#include "moe/prefetcher.h"
#include "placement.h"
#include "sequence_table.h"
#include "sharpi/options.h"
#include "sharpi/predictor.h"
#include "sharpi/types.h"
#include "threads/thread_pool.h"
#include "trace/timeline.h"

namespace sharpi {

class Engine final : private GateObserver {
  public:
    // Checks the options, plans the placement (placement.h), then builds what the plan says.
    Engine(const std::string& path, const SessionOptions& options);

    const ModelInfo& info() const { return info_; }
    const Model& model() const { return *model_; }
    int64_t n_past(int32_t seq = 0) const { return sequences_->at(seq).n_past; }
    // Exact mode (SessionOptions::exact or SHARPI_EXACT=1): f32 activations in every matmul.
    bool exact() const { return exact_; }
    // Forgets sequence `seq`'s positions (and, for sequence 0, a pending cancel()).
    void reset(int32_t seq = 0);
    // Keeps the first n_keep positions and forgets the rest (prompt-prefix reuse). Attention rows
    // beyond n_past are never read, so this only moves n_past. Throws InvalidArgument unless
    // 0 <= n_keep <= n_past, UnsupportedError when the model keeps recurrent (DeltaNet) state and
    // n_keep < n_past: that state has absorbed every position and cannot be rewound.
    void truncate(int64_t n_keep, int32_t seq = 0);

    // Sequences (sequence_table.h). add: a new empty one; fork: a new one holding the first n_keep
    // positions of `src` (its KV rows copied; a recurrent state only as a whole: n_keep must equal
    // src's n_past on a hybrid arch, UnsupportedError otherwise); remove: frees one (not 0).
    int32_t add_sequence();
    int32_t fork_sequence(int32_t src, int64_t n_keep);
    void remove_sequence(int32_t seq);
    std::vector<int32_t> sequence_ids() const { return sequences_->ids(); }
    // The tokens of `seq` in the running (or next) step that holds it are not appended; the step's
    // other sequences go on, and its entry's logits come back empty. Lock-free, async-signal-safe.
    void cancel_sequence(int32_t seq) noexcept { sequences_->request_cancel(seq); }

    std::vector<float> decode(const std::vector<token_t>& tokens, bool all_logits, bool rewindable = false);
    // One step over several sequences (each at most once): entry i's logits ([n_tokens, n_vocab] with
    // all_logits, else its last token's [n_vocab]; empty when cancel_sequence() dropped it). A
    // sequence's logits are bit-identical to decoding it alone with the same token groups.
    std::vector<std::vector<float>> decode_batch(const std::vector<SequenceTokens>& entries);
    // Up to n greedy draft tokens after `next` (the token sequence `seq` decodes next) from the MTP
    // head, chained; with `logits`, each draft position's [n_vocab] logits appended. InvalidArgument
    // without SessionOptions::mtp, for an empty sequence, a token outside the vocabulary or n < 1.
    std::vector<token_t> draft_mtp(int32_t seq, token_t next, int n, std::vector<float>* logits = nullptr);
    // What a step of `tokens` on `seq` would read (Session::predict_step_reads).
    StepReadEstimate predict_step_reads(int32_t seq, const std::vector<token_t>& tokens) const;
    // Asks the running decode(), or the next one, to stop: it throws CancelledError at its next
    // check (before each prefill chunk, each layer and each expert wave of a batch) and appends
    // nothing; the request is then consumed. reset() drops a request no decode has seen yet.
    // Lock-free and async-signal-safe: any thread, or a signal handler, may call it.
    void cancel() noexcept { cancel_requested_.store(true, std::memory_order_relaxed); }
    void clear_cancel() noexcept { cancel_requested_.store(false, std::memory_order_relaxed); }

    const ActivationDump& dump() const { return dump_; }
    // Expert choices of every layer for the tokens of the last decode(): [n_tokens, n_expert_used].
    const std::vector<Routing>& routing() const { return routing_; }

    void set_route_trace(RouteTrace trace);
    Timeline& timeline() { return timeline_; }

    ExpertCacheStats expert_stats() const;
    void reset_stats();

    void set_predictor(std::shared_ptr<Predictor> predictor);
    std::vector<std::string> predictor_errors() const;

    // How ram_budget "auto" was resolved; nothing when the session was given bytes.
    const std::optional<AutoRamBudget>& auto_ram_budget() const { return auto_ram_budget_; }

  private:
    // Replaces the prefetcher (streaming only); nullptr: no prediction.
    void install_predictor(std::shared_ptr<Predictor> predictor);

    // The MoE FFN's gate event (single-token decoding with a prefetcher): passed to the prefetcher.
    void on_gate(int il, int64_t n_rows, const float* hidden, const float* router_logits,
                 const int32_t* selected) override;

    // Checks a step before anything is touched (InvalidArgument / ContextOverflowError).
    void check_step(const std::vector<SequenceTokens>& entries) const;
    // The step's tokens in chunks of at most kMaxBatch rows, layer-major; writes each entry's wanted
    // logits rows. Leaves every n_past alone.
    void forward_step(const std::vector<SequenceTokens>& entries, std::vector<std::vector<float>>& logits);
    // With an MTP head, after a step's trunk: each entry's normed hidden rows into its sequence,
    // and the head over the pairs they complete (its KV rows), in chunks of kMaxBatch.
    void forward_mtp_pairs(const std::vector<SequenceTokens>& entries);
    // The device path (device="cuda"): one sequence.
    void forward_device(const SequenceTokens& entry, std::vector<float>& logits);

    // CancelledError naming where decode() stopped, when cancel() was called.
    void throw_if_cancelled(int il) const;

    // Steps the predictor observes: one token, or 2..kReadAheadMinRows-1 rows holding decode entries
    // (observed_entry: sequences decoding together, a speculative verify step). Every decode row's
    // gates go to the prefetcher (PredictorInput::sequence/row); prompt rows are not shown. The
    // predictor keeps one cross-token history, of the sequence it follows (predictor_seq_): that one
    // when the step holds it as a decode entry, else the first decode entry, whose kept tokens are
    // replayed first (Predictor::observe_context) so the history is its own; its first row alone
    // has updates_state (it folds `prev`). Returns the followed entry; -1 when no entry is observed.
    int64_t begin_prefetch_step(const std::vector<SequenceTokens>& entries,
                                const std::vector<Sequence*>& seqs);
    // A decode entry: one token, or a rewindable (speculative verify) step. Other entries are prompts.
    static bool observed_entry(const SequenceTokens& e);
    // The followed sequence's step of n > 1 rows succeeded, once record_selections has run: its rows
    // but the last to the predictor (the first row folded the token before the step).
    void pass_step_context(Sequence& s, int64_t n);
    // The followed sequence's step failed or was cancelled (nothing appended): the next decode
    // replays its kept tokens.
    void forget_failed_step(Sequence& s);
    // After a one-sequence batched decode of n > 1 tokens, once record_selections has run: the first
    // n - 1 tokens' selections to the predictor (Predictor::observe_context), led by the token decoded
    // just before the batch (every kept token when its history is not s's), so history-keeping
    // predictors see a prompt as if decoded token by token.
    void pass_batch_context(Sequence& s, int64_t n);
    // Stages the first `lookahead` MoE layers of each guessed row (guesses: [rows, n_layer * top_k],
    // -1 none), layer by layer: no gate precedes those layers. Needs a prefetcher.
    void stage_guessed_rows(const std::vector<int32_t>& guesses);
    // After a successful step of step_rows rows: rows [row0, row0 + n) of routing_ join s.selections
    // and the entry's first n tokens s.tokens.
    void record_selections(Sequence& s, const std::vector<token_t>& tokens, int64_t row0, int64_t n,
                           int64_t step_rows);
    // A new Sequence with its KV cache and recurrent state (sequence_table.h's factory).
    std::unique_ptr<Sequence> make_sequence() const;

    static constexpr int64_t kMaxBatch = 256;
    // Steps of 2..kReadAheadMinRows-1 rows do not read ahead: on qwen3-30b-a3b Q4_K_M (random
    // weights) at a 25% expert budget, 2 threads, a step of 5 / 8 / 16 rows took 1.44 / 1.63 / 1.23x
    // longer with it, 2 and 32 rows the same, 64 rows 0.95x, one row the same (docs/speculative.md).
    static constexpr int64_t kReadAheadMinRows = 32;
    static_assert(std::atomic<bool>::is_always_lock_free, "cancel() must be async-signal-safe");

    SessionOptions options_;
    bool exact_ = false;
    std::unique_ptr<Model> model_;
    ModelInfo info_;
    std::unique_ptr<ThreadPool> pool_;
    KvLayout kv_shape_;
    int64_t n_ctx_ = 0;
    std::unique_ptr<SequenceTable> sequences_;
    // device="cuda": the forward pass on the device (weights, KV cache and activations in VRAM);
    // decode() hands it the tokens instead of running forward_batch.
    std::unique_ptr<cuda::DeviceForward> device_;
    std::unique_ptr<ExpertSource> experts_;
    // A multi-token step's last chunk reads each next MoE layer's guessed experts while a layer
    // computes (docs/streaming_io.md): prefill, and a speculative verify step's draft rows.
    // SHARPI_READ_AHEAD=0 in the environment turns it off (benchmarks measure what it saves).
    bool read_ahead_ = true;
    // With a prefetcher and SHARPI_ECHO_PREFETCH=1 in the environment, each observed step's first
    // MoE layers (and an MTP draft's rows while it drafts) are staged from echo guesses
    // (stage_guessed_rows). Off by default: on olmoe-1b-7b Q4_K_M (random weights) at 25% of
    // experts, io_uring, sessions alternating, it made one-token steps 241 against 178 ms and
    // verify steps of 2 / 4 drafts 552 / 971 against 479 / 802 ms, although more of their experts
    // hit: the first layer leaves no compute to hide a read behind, and a wrong guess already on
    // the device delays the gate's demand reads (docs/speculative.md).
    bool echo_prefetch_ = false;
    std::unique_ptr<MtpHead> mtp_;               // SessionOptions::mtp
    std::unique_ptr<ExpertSource> mtp_experts_;  // the head's experts, resident
    ExpertCache* cache_ = nullptr;               // experts_ when streaming, else nullptr
    ExpertCacheStats plan_;                      // budget, fixed bytes, slots (streaming only)
    std::optional<AutoRamBudget> auto_ram_budget_;
    Scratch scratch_;                   // the CPU backend's activations
    std::unique_ptr<Backend> backend_;  // computes forward_batch's layers (device="cpu")
    std::vector<float> residual_;
    ActivationDump dump_;
    std::vector<Routing> routing_;
    RouteTrace route_trace_;                  // n_tokens == 0: replay off
    std::unique_ptr<Prefetcher> prefetcher_;  // streaming with a predictor only
    int32_t predictor_seq_ = 0;               // whose history the predictor holds; -1: nobody's
    int64_t followed_entry_ = -1;             // the running step's followed entry; -1: not observed
    std::vector<int32_t> step_echo_;          // the running step's echo guesses (PrefetchRow::echo)
    double decode_ms_ = 0.0;
    Timeline timeline_;
    std::atomic<bool> cancel_requested_{false};
};

}  // namespace sharpi
