// depthtime: softmax regression over depth and time, mixed per target with the previous token
// (docs/predictors.md, "depthtime").
//
//     reg_t = bias[t] + sum_{l=0}^{L} sum_{i in S(l)} layer[t, t-l-1, i]
//                     + sum_{r=-1..1, 0 <= t+r < n_layer} sum_{i in P(t+r)} prev[t, r+1, i]
//     score_{t,d} = mix[d-1, t, 0] * reg_t + mix[d-1, t, 1] * [expert in P(t)]
//
// with L = t - d the source layer. Each term is one contiguous row of E floats, so a call is at
// most (L + 4) * top_k + 1 row adds (the regression is skipped when its weight is 0). Owns copies of
// the four tables (the file is closed after load); stateless between calls. Expert ids outside
// [0, E) in history / prev (the -1 of "unknown") contribute nothing.
#include <memory>
#include <string>

#include "predict/predictor.h"
#include "predict/sidecar.h"
#include "sharpi/errors.h"

namespace sharpi {

namespace {

class DepthTimePredictor final : public ScoringPredictor {
  public:
    explicit DepthTimePredictor(const SidecarReader& file)
        : ScoringPredictor(file.header().n_expert, file.header().top_k),
          n_layer_(file.header().n_layer),
          max_lookahead_(file.header().max_lookahead) {
        const int64_t E = n_expert_;
        n_off_ = n_layer_ > 1 ? n_layer_ - 1 : 1;
        bias_ = file.tensor("dt.bias", {n_layer_, E});
        layer_ = file.tensor("dt.layer", {n_layer_, n_off_, E, E});
        prev_ = file.tensor("dt.prev", {n_layer_, kPrevOffsets, E, E});
        mix_ = file.tensor("dt.mix", {max_lookahead_, n_layer_, 2});
    }

    const char* name() const override { return "depthtime"; }

    bool predicts(const PredictorInput& in, int d) const override {
        return d >= 1 && d <= max_lookahead_ && in.layer >= 0 && in.layer + d < n_layer_;
    }

    void scores(const PredictorInput& in, int d, float* out) override {
        const int64_t E = n_expert_;
        const int64_t t = in.layer + d;
        const float w_reg = mix_[static_cast<size_t>(((d - 1) * n_layer_ + t) * 2)];
        const float alpha = mix_[static_cast<size_t>(((d - 1) * n_layer_ + t) * 2 + 1)];
        for (int64_t e = 0; e < E; ++e) out[e] = 0.0f;
        if (w_reg != 0.0f) {
            const float* bias = bias_.data() + t * E;
            for (int64_t e = 0; e < E; ++e) out[e] = bias[e];
            // Depth: every layer l <= in.layer of this token (all known), at offset t - l.
            for (int64_t l = 0; l <= in.layer; ++l) {
                const float* table = layer_.data() + (t * n_off_ + (t - l - 1)) * E * E;
                add_table_rows(table, in.history + l * top_k_, top_k_, E, out);
            }
            // Time: the previous token at t-1, t, t+1.
            for (int64_t r = -1; r <= 1; ++r) {
                if (t + r < 0 || t + r >= n_layer_) continue;
                const float* table = prev_.data() + (t * kPrevOffsets + (r + 1)) * E * E;
                add_table_rows(table, in.prev + (t + r) * top_k_, top_k_, E, out);
            }
            if (w_reg != 1.0f)
                for (int64_t e = 0; e < E; ++e) out[e] *= w_reg;
        }
        if (alpha != 0.0f) {
            const int32_t* ids = in.prev + t * top_k_;
            for (int64_t j = 0; j < top_k_; ++j)
                if (ids[j] >= 0 && ids[j] < E) out[ids[j]] += alpha;
        }
    }

  private:
    static constexpr int64_t kPrevOffsets = 3;  // previous token's layers t-1, t, t+1
    int64_t n_layer_;
    int max_lookahead_;
    int64_t n_off_ = 0;  // n_layer - 1 offsets o = t - l = 1 .. n_layer-1
    std::vector<float> bias_, layer_, prev_, mix_;
};

}  // namespace

std::unique_ptr<Predictor> load_depthtime_predictor(const std::string& file, const Model& model,
                                                    int lookahead) {
    SidecarReader reader(file, "depthtime", model, lookahead);
    return std::make_unique<DepthTimePredictor>(reader);
}

}  // namespace sharpi
