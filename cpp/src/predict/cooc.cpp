// cooc: cross-layer co-occurrence scores (docs/predictors.md, "cooc").
//
//     score_t = bias[t] + sum_{o=d}^{d+m-1, t-o >= 0} sum_{i in S(t-o)} layer[t, o-1, i]
//                       + sum_{i in P(t)} prev[t, i]
//
// Each term is one contiguous row of E floats, so a call is at most (m + 1) * top_k + 1 row adds.
// Owns copies of the three tables (the file is closed after load); stateless between calls.
// Expert ids outside [0, E) in history / prev (the -1 of "unknown") contribute nothing.
#include <memory>
#include <string>

#include "predict/predictor.h"
#include "predict/sidecar.h"
#include "sharpi/errors.h"

namespace sharpi {

namespace {

class CoocPredictor final : public ScoringPredictor {
  public:
    explicit CoocPredictor(const SidecarReader& file)
        : ScoringPredictor(file.header().n_expert, file.header().top_k),
          n_layer_(file.header().n_layer),
          max_lookahead_(file.header().max_lookahead) {
        history_ = file.uint_key("cooc.history", 1, 64);
        n_off_ = max_lookahead_ + history_ - 1;
        const int64_t E = n_expert_;
        bias_ = file.tensor("cooc.bias", {n_layer_, E});
        layer_ = file.tensor("cooc.layer", {n_layer_, n_off_, E, E});
        prev_ = file.tensor("cooc.prev", {n_layer_, E, E});
    }

    const char* name() const override { return "cooc"; }

    bool predicts(const PredictorInput& in, int d) const override {
        return d >= 1 && d <= max_lookahead_ && in.layer >= 0 && in.layer + d < n_layer_;
    }

    void scores(const PredictorInput& in, int d, float* out) override {
        const int64_t E = n_expert_;
        const int64_t t = in.layer + d;
        const float* bias = bias_.data() + t * E;
        for (int64_t e = 0; e < E; ++e) out[e] = bias[e];
        // Offsets o = d .. d+m-1 look back from t to layers t-o <= in.layer, all known this token.
        for (int64_t o = d; o < d + history_ && t - o >= 0; ++o) {
            const int32_t* selected = in.history + (t - o) * top_k_;
            const float* table = layer_.data() + (t * n_off_ + (o - 1)) * E * E;
            add_rows(table, selected, out);
        }
        add_rows(prev_.data() + t * E * E, in.prev + t * top_k_, out);
    }

  private:
    void add_rows(const float* table, const int32_t* ids, float* out) const {
        add_table_rows(table, ids, top_k_, n_expert_, out);
    }

    int64_t n_layer_;
    int max_lookahead_;
    int64_t history_ = 0;  // m: layers of the current token each prediction looks back over
    int64_t n_off_ = 0;    // max_lookahead + m - 1 offsets o = 1 .. n_off
    std::vector<float> bias_, layer_, prev_;
};

}  // namespace

std::unique_ptr<Predictor> load_cooc_predictor(const std::string& file, const Model& model, int lookahead) {
    SidecarReader reader(file, "cooc", model, lookahead);
    return std::make_unique<CoocPredictor>(reader);
}

}  // namespace sharpi
