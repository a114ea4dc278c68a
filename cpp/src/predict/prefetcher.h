// Prefetcher: turns a predictor's hints into early expert reads (DESIGN §3-§4, docs/predictors.md).
//
// Data flows one way: predictor -> prefetcher -> cache.prefetch() -> reader. The prefetcher owns
// the token's routing history, the prediction-quality counters and the timeliness test; it never
// touches slots (the cache decides what is present and where staged bytes go) and it never evicts:
// every read it starts lands in a staging slot. Decode thread only.
//
// Per decoded token: begin_token(prev) once, then on_gate(il, ...) for each MoE layer in order,
// called after that layer's demand reads went out (so prefetches queue behind them).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cache/expert_cache.h"
#include "model/forward.h"
#include "sharpi/predictor.h"
#include "sharpi/types.h"

namespace sharpi {

class Prefetcher final : public GateObserver {
  public:
    Prefetcher(const HParams& hp, ExpertCache& cache, std::shared_ptr<Predictor> predictor, int lookahead,
               bool skip_late);

    // A new token: `prev` is the previous token's selections [n_layer * top_k] (nullptr: none).
    // Forgets predictions made for a token that did not finish (a failed decode).
    void begin_token(const int32_t* prev);
    void on_gate(int il, const float* hidden, const float* router_logits, const int32_t* selected) override;

    // Merges the prediction counters into `st` (per layer) and adds predict_ms and call counts.
    void add_stats(ExpertCacheStats& st) const;
    void reset_stats();
    // The last few error messages of predictor calls that threw (oldest first).
    const std::vector<std::string>& errors() const { return errors_; }
    const Predictor& predictor() const { return *predictor_; }

  private:
    using Clock = std::chrono::steady_clock;
    void score_predictions(int il, const int32_t* selected);
    void issue(int il, std::vector<PrefetchHint>& hints);

    const int n_layer_, n_expert_, top_k_, n_embd_, lookahead_;
    const bool skip_late_;
    ExpertCache& cache_;
    std::shared_ptr<Predictor> predictor_;

    std::vector<int32_t> history_, prev_;  // [n_layer * top_k], -1 = unknown
    // Prediction sets made for each target layer during this token, scored when its gate fires.
    std::vector<std::vector<std::vector<int32_t>>> pending_;
    std::vector<PrefetchHint> hints_;

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
