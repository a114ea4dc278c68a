// The engine behind sharpi::Session: owns the model, the KV cache, the thread pool, the expert
// source (resident, or the streaming ExpertCache), the prefetcher and the scratch arena, and runs
// the decode loop: embed, every layer, output head (model/forward.h), in chunks of kMaxBatch
// tokens. It orchestrates and never calls a kernel. It is the GateObserver of the MoE FFN and
// hands every gate event to the prefetcher (the layer code never sees the prefetcher).
//
// Single-threaded API: one caller at a time drives decode(); parallelism is inside (the pool).
// The one exception is cancel(), callable from any thread or a signal handler while decode() runs.
// Failure atomicity: decode() validates everything before it touches state, and advances n_past
// only after the whole batch succeeded, so an exception (CancelledError included) leaves the
// session usable at the old position (positions beyond n_past in the KV cache are never read).
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
#include "model/recurrent_state.h"
#include "moe/expert_cache.h"
#include "moe/expert_source.h"
#include "moe/moe_ffn.h"
#include "moe/prefetcher.h"
#include "placement.h"
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
    int64_t n_past() const { return n_past_; }
    // Exact mode (SessionOptions::exact or SHARPI_EXACT=1): f32 activations in every matmul.
    bool exact() const { return exact_; }
    void reset();
    // Keeps the first n_keep positions and forgets the rest (prompt-prefix reuse). Attention rows
    // beyond n_past are never read, so this only moves n_past. Throws InvalidArgument unless
    // 0 <= n_keep <= n_past, UnsupportedError when the model keeps recurrent (DeltaNet) state and
    // n_keep < n_past: that state has absorbed every position and cannot be rewound.
    void truncate(int64_t n_keep);

    std::vector<float> decode(const std::vector<token_t>& tokens, bool all_logits);
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
    void on_gate(int il, const float* hidden, const float* router_logits, const int32_t* selected) override;

    // The n tokens at positions n_past_.. in chunks of at most kMaxBatch, layer-major; writes the
    // logits of every row (all_logits) or of the last row to `logits`. Leaves n_past_ alone.
    void forward_batch(const token_t* tokens, int64_t n, bool all_logits, float* logits);

    // CancelledError naming where decode() stopped, when cancel() was called.
    void throw_if_cancelled(int il) const;

    // Single-token decoding with a prefetcher: the previous token is the last row of
    // sequence_selection_ (none at the start of a sequence); after a truncate() the kept tokens
    // before it are replayed first (Predictor::observe_context), so the predictor's history is the
    // kept sequence.
    void begin_prefetch_token();
    // A decode of n tokens failed or was cancelled (nothing appended): after a single token, whose
    // gates the predictor saw, the next decode replays the kept sequence (replay_history_).
    void forget_failed_token(int64_t n);
    // After a batched decode of n > 1 tokens, once record_selections(n) has run: the first n - 1
    // tokens' selections to the predictor (Predictor::observe_context), led by the token decoded just
    // before the batch (every kept token after a truncate()), so history-keeping predictors see a
    // prompt as if decoded token by token.
    void pass_batch_context(int64_t n);
    // After a successful decode of n tokens: their rows from routing_ join sequence_selection_.
    void record_selections(int64_t n);

    static constexpr int64_t kMaxBatch = 256;
    static_assert(std::atomic<bool>::is_always_lock_free, "cancel() must be async-signal-safe");

    SessionOptions options_;
    bool exact_ = false;
    std::unique_ptr<Model> model_;
    ModelInfo info_;
    std::unique_ptr<ThreadPool> pool_;
    std::unique_ptr<KvCache> kv_;  // device="cpu" only
    // device="cuda": the forward pass on the device (weights, KV cache and activations in VRAM);
    // decode() hands it the tokens instead of running forward_batch.
    std::unique_ptr<cuda::DeviceForward> device_;
    std::unique_ptr<RecurrentState> recurrent_;  // DeltaNet layers' state (hybrid archs)
    std::unique_ptr<ExpertSource> experts_;
    ExpertCache* cache_ = nullptr;  // experts_ when streaming, else nullptr
    ExpertCacheStats plan_;         // budget, fixed bytes, slots (streaming only)
    std::optional<AutoRamBudget> auto_ram_budget_;
    Scratch scratch_;                   // the CPU backend's activations
    std::unique_ptr<Backend> backend_;  // computes forward_batch's layers (device="cpu")
    std::vector<float> residual_;
    int64_t n_past_ = 0;
    ActivationDump dump_;
    std::vector<Routing> routing_;
    RouteTrace route_trace_;                  // n_tokens == 0: replay off
    std::unique_ptr<Prefetcher> prefetcher_;  // streaming with a predictor only
    // With a prefetcher: the experts of every token of the sequence, [n_past, n_layer * top_k]
    // (-1 where a layer has no routing), so a truncate() rewinds the predictor's history instead of
    // losing it. Invariant: n_past_ rows.
    std::vector<int32_t> sequence_selection_;
    // truncate() dropped tokens the predictor had folded in, or a failed single-token decode showed
    // it gates of a token that was not appended: the next decode hands it the kept sequence again,
    // as a new sequence.
    bool replay_history_ = false;
    double decode_ms_ = 0.0;
    Timeline timeline_;
    std::atomic<bool> cancel_requested_{false};
};

}  // namespace sharpi
