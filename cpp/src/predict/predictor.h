// The built-in predictors (docs/design.md §6, docs/predictors.md); the interface itself is public
// (sharpi/predictor.h). Predictors never touch the cache or the reader: the prefetcher turns their
// hints into reads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/model.h"
#include "sharpi/predictor.h"

namespace sharpi {

// A predictor that scores every expert of each target layer (cooc, depthtime, learned, trajectory,
// next_gate, pregate): observe() is the top-k of scores() for each d (k = in.hints_per_layer, or
// top_k when that is 0). scores() is public so tests
// can compare the raw scores with an independent numpy implementation.
class ScoringPredictor : public Predictor {
  public:
    // Whether it predicts layer in.layer + d at all (e.g. pregate only d = 1, nothing past the last layer).
    virtual bool predicts(const PredictorInput& in, int d) const = 0;
    // out: [n_expert] scores of layer in.layer + d. Only called when predicts(in, d).
    virtual void scores(const PredictorInput& in, int d, float* out) = 0;
    void observe(const PredictorInput& in, std::vector<PrefetchHint>& hints) override;

  protected:
    ScoringPredictor(int64_t n_expert, int64_t top_k) : n_expert_(n_expert), top_k_(top_k), buf_(n_expert) {}
    int64_t n_expert_, top_k_;
    std::vector<float> buf_;
};

// The top-k experts of `scores` (ties: lower id first) as hints for `target_layer`.
void append_topk_hints(const float* scores, int64_t n_expert, int64_t k, int target_layer,
                       std::vector<PrefetchHint>& hints);

// out[0..n_expert) += table[i] for each id i of ids[0..n_ids) inside [0, n_expert); table is
// [n_expert, n_expert] row-major. Ids outside the range (the -1 of "unknown") add nothing. The one
// inner loop of the table predictors (cooc, depthtime).
void add_table_rows(const float* table, const int32_t* ids, int64_t n_ids, int64_t n_expert, float* out);

// logits [n_expert] = the router of model layer `layer` applied to rms_norm(hidden) * ffn_norm of that
// layer, plus the router's bias (gpt-oss); with `pregate`, the layer's pre-gate instead (no bias).
// normed: scratch of n_embd floats. The score of next_gate and pregate, and depthtime's gate feature.
// The layer must have that matrix.
void gate_logits(const Model& model, int layer, bool pregate, const float* hidden, float* normed,
                 float* logits);

// Throws InvalidArgument unless 1 <= lookahead <= 3 (the distances a prediction may reach).
void check_lookahead(int lookahead);

// Built-in predictors by name: "prev_token", "echo", "next_gate", "pregate" need only the model;
// "cooc", "depthtime", "learned", "trajectory" need a sidecar file (docs/predictors.md), `file` may be empty
// otherwise. "none" returns nullptr. Throws InvalidArgument for an unknown name, a missing or
// mismatched file (naming both shapes), or a model without pregate tensors for "pregate";
// FormatError for a corrupt sidecar. `max_lookahead` is the session's lookahead.
std::unique_ptr<Predictor> make_predictor(const std::string& name, const std::string& file,
                                          const Model& model, int lookahead);

// Sidecar-backed predictors (cpp/src/predict/{cooc,depthtime,learned,trajectory}.cpp). Each validates the
// file against the model and the lookahead and throws as make_predictor documents.
std::unique_ptr<Predictor> load_cooc_predictor(const std::string& file, const Model& model, int lookahead);
std::unique_ptr<Predictor> load_depthtime_predictor(const std::string& file, const Model& model,
                                                    int lookahead);
std::unique_ptr<Predictor> load_learned_predictor(const std::string& file, const Model& model, int lookahead);
std::unique_ptr<Predictor> load_trajectory_predictor(const std::string& file, const Model& model,
                                                     int lookahead);

}  // namespace sharpi
