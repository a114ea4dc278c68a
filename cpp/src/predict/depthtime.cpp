// depthtime: softmax regression over depth and time, mixed per target with the previous token
// (docs/predictors.md, "depthtime").
//
//     reg_t = bias[t] + sum_{l=0}^{L} sum_{i in S(l)} layer[t, t-l-1, i]
//                     + sum_{r=-1..1, 0 <= t+r < n_layer} sum_{i in P(t+r)} prev[t, r+1, i]
//     count_{t,d} = count_bias[t] + sum_{i in S(t-d)} count[t, d-1, i]
//     hist_t      = sum_{j >= 1} decay[t]^(j-1) * [expert in S_{-j}(t)]   (S_{-j}: j tokens back)
//     score_{t,d} = mix[d-1, t, 0] * reg_t + mix[d-1, t, 1] * count_{t,d} + mix[d-1, t, 2] * [expert in P(t)]
//                 + mix[d-1, t, 3] * hist_t
//
// with L = t - d the source layer. Each term is one contiguous row of E floats, so a call is at
// most (L + 5) * top_k + 3 row adds (a member whose weight is 0 is skipped). Owns copies of
// the seven tables (the file is closed after load). Expert ids outside [0, E) in history / prev
// (the -1 of "unknown") contribute nothing.
//
// State: hist_ [n_layer, E], the decayed counts of the tokens before the current one (topic
// persistence in decode). observe() at layer 0 folds in the previous token (hist = decay * hist +
// [expert in P]) before scoring, or clears hist when there is no previous token (a new sequence
// or a reset session); scores() only reads it. The engine calls observe() for every decoded token
// from layer 0 in order (DESIGN §6), so hist covers every decoded token since the last reset; a
// batched prefill's tokens are not observed, so after one the history starts at its last token.
#include <memory>
#include <string>
#include <vector>

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
        count_bias_ = file.tensor("dt.count_bias", {n_layer_, E});
        count_ = file.tensor("dt.count", {n_layer_, max_lookahead_, E, E});
        mix_ = file.tensor("dt.mix", {max_lookahead_, n_layer_, kMembers});
        decay_ = file.tensor("dt.decay", {n_layer_});
        hist_.assign(static_cast<size_t>(n_layer_ * E), 0.0f);
    }

    const char* name() const override { return "depthtime"; }

    void observe(const PredictorInput& in, std::vector<PrefetchHint>& hints) override {
        if (in.layer == 0) fold_previous_token(in.prev);
        ScoringPredictor::observe(in, hints);
    }

    bool predicts(const PredictorInput& in, int d) const override {
        return d >= 1 && d <= max_lookahead_ && in.layer >= 0 && in.layer + d < n_layer_;
    }

    void scores(const PredictorInput& in, int d, float* out) override {
        const int64_t E = n_expert_;
        const int64_t t = in.layer + d;
        const float* mix = mix_.data() + ((d - 1) * n_layer_ + t) * kMembers;
        const float w_reg = mix[0], w_count = mix[1], alpha = mix[2], beta = mix[3];
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
        if (w_count != 0.0f) {
            // Co-occurrence counts of layer L alone (the row sum is formed first, then weighted, in
            // the order the reference adds them).
            count_row_.assign(count_bias_.begin() + t * E, count_bias_.begin() + (t + 1) * E);
            const float* table = count_.data() + (t * max_lookahead_ + (d - 1)) * E * E;
            add_table_rows(table, in.history + in.layer * top_k_, top_k_, E, count_row_.data());
            for (int64_t e = 0; e < E; ++e) out[e] += w_count * count_row_[static_cast<size_t>(e)];
        }
        if (alpha != 0.0f) {
            const int32_t* ids = in.prev + t * top_k_;
            for (int64_t j = 0; j < top_k_; ++j)
                if (ids[j] >= 0 && ids[j] < E) out[ids[j]] += alpha;
        }
        if (beta != 0.0f) {
            const float* hist = hist_.data() + t * E;
            for (int64_t e = 0; e < E; ++e) out[e] += beta * hist[e];
        }
    }

  private:
    // hist = decay * hist + [expert in P] per layer, or 0 when prev names no expert at all.
    void fold_previous_token(const int32_t* prev) {
        const int64_t E = n_expert_;
        bool any = false;
        for (int64_t i = 0; i < n_layer_ * top_k_; ++i) any = any || (prev[i] >= 0 && prev[i] < E);
        for (int64_t l = 0; l < n_layer_; ++l) {
            float* hist = hist_.data() + l * E;
            const float g = any ? decay_[static_cast<size_t>(l)] : 0.0f;
            for (int64_t e = 0; e < E; ++e) hist[e] *= g;
            if (!any) continue;
            const int32_t* ids = prev + l * top_k_;
            for (int64_t j = 0; j < top_k_; ++j)
                if (ids[j] >= 0 && ids[j] < E) hist[ids[j]] += 1.0f;
        }
    }

    static constexpr int64_t kPrevOffsets = 3;  // previous token's layers t-1, t, t+1
    static constexpr int64_t kMembers = 4;      // mix weights: regression, counts, previous token, history
    int64_t n_layer_;
    int max_lookahead_;
    int64_t n_off_ = 0;  // n_layer - 1 offsets o = t - l = 1 .. n_layer-1
    std::vector<float> bias_, layer_, prev_, count_bias_, count_, mix_, decay_;
    std::vector<float> count_row_;  // scratch: count_{t,d}
    std::vector<float> hist_;       // state: hist_t of the current token, [n_layer, E]
};

}  // namespace

std::unique_ptr<Predictor> load_depthtime_predictor(const std::string& file, const Model& model,
                                                    int lookahead) {
    SidecarReader reader(file, "depthtime", model, lookahead);
    return std::make_unique<DepthTimePredictor>(reader);
}

}  // namespace sharpi
