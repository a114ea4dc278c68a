// Prefetcher: turns a predictor's hints into early expert reads (docs/design.md §3-§4, docs/predictors.md).
//
// Data flows one way: predictor -> prefetcher -> cache.prefetch() -> reader. The prefetcher owns
// the token's routing history, the prediction-quality counters and the timeliness test (from the
// reader's own load: ExpertReader::inflight_bytes / bytes_per_ms); it never touches slots (the
// cache decides what is present and where staged bytes go) and it never evicts: every read it
// starts lands in a staging slot. Predictors (predict/) only produce hints and never see the cache.
// Decode thread only; the engine drives it, never the layer code.
//
// How many hints of a target layer become reads is the sizing's (moe/prefetch_sizing.h): the best
// top_k ("topk"), or those whose expected stall saved beats a wasted read's cost ("bytes").
//
// Per observed step (one decoded token, or the few rows of a multi-sequence / verify step):
// begin_step(rows) once, then on_gate(il, ...) for each MoE layer in order with every row's gate,
// called after that layer's demand reads went out (so prefetches queue behind them). Each row keeps
// its own history and prediction sets; the hints of all rows go to the cache, which reads an
// expert once however many rows name it.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moe/expert_cache.h"
#include "moe/prefetch_sizing.h"
#include "sharpi/predictor.h"
#include "sharpi/types.h"

namespace sharpi {

// The model dimensions the prefetcher needs (from HParams; kept plain so moe/ needs no model/).
struct PrefetchShape {
    int n_layer = 0, n_expert = 0, top_k = 0, n_embd = 0;
};

// One observed row of a step: the token's sequence and what its `prev` is (PredictorInput).
struct PrefetchRow {
    int32_t sequence = 0;
    const int32_t* prev = nullptr;  // the previous token's selections [n_layer * top_k]; nullptr: none
    int prev_row = -1;              // >= 0: the previous token is that earlier row of the step instead
    bool updates_state = true;      // PredictorInput::updates_state
    bool observed = true;           // false: a prompt row, shown to no predictor
    const int32_t* echo = nullptr;  // PredictorInput::echo; valid until the next begin_step
};

class Prefetcher final {
  public:
    Prefetcher(const PrefetchShape& shape, ExpertCache& cache, std::shared_ptr<Predictor> predictor,
               int lookahead, bool skip_late, PrefetchSizing sizing = PrefetchSizing::topk);

    // A new step of rows.size() rows (at least one; prev_row < the row's own index). Forgets
    // predictions made for a step that did not finish (a failed decode).
    void begin_step(const std::vector<PrefetchRow>& rows);
    // Layer il's gate fired for every row of the step (GateObserver::on_gate's layout).
    void on_gate(int il, int64_t n_rows, const float* hidden, const float* router_logits,
                 const int32_t* selected);
    // Before the step's first gate: stages `experts` [n] guessed for layer `target_layer` (echo
    // guesses, predict/echo_guess.h: the first MoE layers, which no gate precedes). Each is hinted
    // to the cache and read into a staging slot unless present; none is scored as a prediction (the
    // cache's prefetch_issued / prefetch_used count them). Ids outside [0, n_expert) are ignored.
    void stage_guesses(int target_layer, const int32_t* experts, int64_t n);
    // A batched decode of n_tokens + 1 tokens finished: hands the first n_tokens tokens' selections
    // [n_tokens * n_layer * top_k] to the predictor (Predictor::observe_context). A throw is counted
    // and kept like observe()'s.
    void observe_context(const int32_t* selections, int64_t n_tokens, bool new_sequence);

    // Merges the prediction counters into `st` (per layer) and adds predict_ms and call counts.
    void add_stats(ExpertCacheStats& st) const;
    void reset_stats();
    // The last few error messages of predictor calls that threw (oldest first).
    const std::vector<std::string>& errors() const { return errors_; }
    const Predictor& predictor() const { return *predictor_; }

  private:
    using Clock = std::chrono::steady_clock;
    // One row's state within the step.
    struct Row {
        PrefetchRow source;
        std::vector<int32_t> history, prev;  // [n_layer * top_k], -1 = unknown
        // Prediction sets made for each target layer during this step, scored when its gate fires.
        std::vector<std::vector<std::vector<int32_t>>> pending;
    };
    void score_predictions(Row& row, int il, const int32_t* selected);
    void observe_row(Row& row, int r, int il, const float* hidden, const float* router_logits);
    void issue(Row& row, int il, std::vector<PrefetchHint>& hints);
    // The "bytes" sizing rule (moe/prefetch_sizing.h) for hints already ordered by order_hints.
    void issue_by_bytes(Row& row, int il, const std::vector<PrefetchHint>& hints);
    // Starts one read into a staging slot; false when no slot was free (counted as skipped).
    bool start_read(int t, int32_t e);

    const int n_layer_, n_expert_, top_k_, n_embd_, lookahead_;
    const bool skip_late_;
    const PrefetchSizing sizing_;
    ExpertCache& cache_;
    std::shared_ptr<Predictor> predictor_;

    std::vector<Row> rows_;  // the step's rows; kept between steps so their buffers are reused
    size_t n_rows_ = 0;      // rows_[0, n_rows_) are the current step's
    std::vector<PrefetchHint> hints_;
    ByteSizedPrefetch plan_;  // issue_by_bytes's scratch

    // Time from one layer's gate to the next one's (exponential moving average), the unit of the
    // timeliness test. 0 until measured.
    double layer_ms_ = 0.0;
    int last_layer_ = -1;
    Clock::time_point last_gate_;

    std::vector<LayerExpertStats> stats_;  // only the prediction fields are used
    double predict_ms_ = 0.0;
    uint64_t calls_ = 0, failures_ = 0;
    std::vector<std::string> errors_;
};

}  // namespace sharpi
