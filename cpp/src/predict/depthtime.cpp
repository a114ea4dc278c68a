// depthtime: a per-(d, t) linear stacker over depth and time features of every expert
// (docs/predictors.md, "depthtime"; the float64 reference is reference.DepthTimePredictor).
//
//     score_{t,d} = sum_f stack[d-1, t, f] * feature_f      (L = t - d the source layer)
//
// over the features, in this order (S(l): the current token's set at layer l; S_{-j}(l): that of the
// token j steps back in the same sequence, P = S_{-1}; n: the earlier tokens of the sequence):
//     reg      bias[t] + sum_{l<=L} sum_{i in S(l)} layer[t, t-l-1, i]
//                      + sum_{r=-1..1, 0<=t+r<n_layer} sum_{i in P(t+r)} prev[t, r+1, i]
//     cnt      count_bias[t] + sum_{i in S(L)} count[t, d-1, i]
//     prev1..4 [e in S_{-j}(t)]
//     hist<λ>  sum_{j=1..n} λ^(j-1) [e in S_{-j}(t)]        λ = 0.5, 0.8, 0.9, 0.97
//     freq     (1/n) sum_{j=1..n} [e in S_{-j}(t)]
//     vote<p>  sum_{j=1..min(n,W)} m_j^p [e in S_{-j}(t)]    p = 1, 4, 16; W = kVoteWindow
//     nvote<p> vote<p> / max(sum_{j=1..min(n,W)} m_j^p, 1e-6)
//     with m_j = sum_{l<=L} |S(l) ∩ S_{-j}(l)| / (top_k (L+1)) (how closely token -j routed like this one)
// and then 16 products of two of them (kProductOf; regp = softmax of reg over the experts):
//     reg * {vote, nvote}<p>, regp * {vote, nvote}<p>, reg * prev1, reg * hist0.9, reg * freq, cnt * nvote4
// and, when the sidecar has depthtime.gate = 1 (trained with the model on a trace with hidden states):
//     gate     layer t's router applied to ffn_norm_t(hidden_L): next_gate's score (gate_logits)
//     gatep    softmax of gate over the experts
//
// A feature with weight 0 that no weighted product needs is not computed (a target whose training
// kept one feature alone costs only that feature). Expert ids outside [0, E) (the -1 of "unknown")
// are in no set.
//
// State (what the time features need), built only from the previous token that observe() sees at
// layer 0 of each token: a ring of the last kVoteWindow tokens' selections, the four decayed counts and
// the running counts per layer, and the number of tokens seen. A previous token naming no expert at
// all (a new sequence or a reset session) clears it. The engine calls observe() for every decoded
// token from layer 0 in order (DESIGN §6), so the state covers every decoded token since the last
// reset; a batched prefill's tokens are not observed, so after one it starts at the prompt's last
// token. scores() only reads that state; the route overlaps m_j of the current token are a cache it
// keeps, checked against in.history on every call (recomputed from layer 0 when they differ).
#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "predict/predictor.h"
#include "predict/sidecar.h"
#include "sharpi/errors.h"

namespace sharpi {

namespace {

constexpr int kPrevTokens = 4;                                       // prev1..prev4
constexpr std::array<float, 4> kDecays = {0.5f, 0.8f, 0.9f, 0.97f};  // hist<λ>
constexpr int kVotePowers = 3;                                       // vote1, vote4, vote16
constexpr int64_t kVoteWindow = 1024;                                // sidecar.DEPTHTIME_VOTE_WINDOW
// Feature columns of dt.stack (sidecar.DEPTHTIME_FEATURES).
constexpr int kReg = 0, kCnt = 1, kPrev = 2, kHist = kPrev + kPrevTokens, kFreq = kHist + 4,
              kVote = kFreq + 1, kNormVote = kVote + kVotePowers, kBase = kNormVote + kVotePowers;
// Then the products a * b of pairs of those (a kRegProb factor: the softmax of reg over the experts).
constexpr int kRegProb = -1, kProducts = 16, kFeatures = kBase + kProducts;
constexpr int kGate = kFeatures, kGateProb = kFeatures + 1;  // the optional last two columns
constexpr int kProductOf[kProducts][2] = {
    {kReg, kVote},         {kReg, kVote + 1},         {kReg, kVote + 2},
    {kReg, kNormVote},     {kReg, kNormVote + 1},     {kReg, kNormVote + 2},
    {kRegProb, kVote},     {kRegProb, kVote + 1},     {kRegProb, kVote + 2},
    {kRegProb, kNormVote}, {kRegProb, kNormVote + 1}, {kRegProb, kNormVote + 2},
    {kReg, kPrev},         {kReg, kHist + 2},         {kReg, kFreq},
    {kCnt, kNormVote + 1}};

class DepthTimePredictor final : public ScoringPredictor {
  public:
    DepthTimePredictor(const SidecarReader& file, const Model& model)
        : ScoringPredictor(file.header().n_expert, file.header().top_k),
          n_layer_(file.header().n_layer),
          max_lookahead_(file.header().max_lookahead),
          model_(model),
          first_moe_layer_(static_cast<int>(model.hp.n_layer_dense_lead)),
          gate_(file.uint_key_or("depthtime.gate", 0, 0, 1) == 1),
          n_features_(kFeatures + (gate_ ? 2 : 0)) {
        const int64_t E = n_expert_;
        n_off_ = n_layer_ > 1 ? n_layer_ - 1 : 1;
        bias_ = file.tensor("dt.bias", {n_layer_, E});
        layer_ = file.tensor("dt.layer", {n_layer_, n_off_, E, E});
        prev_ = file.tensor("dt.prev", {n_layer_, kPrevOffsets, E, E});
        count_bias_ = file.tensor("dt.count_bias", {n_layer_, E});
        count_ = file.tensor("dt.count", {n_layer_, max_lookahead_, E, E});
        stack_ = file.tensor("dt.stack", {max_lookahead_, n_layer_, n_features_});
        if (gate_) {
            for (int64_t t = 0; t < n_layer_; ++t) {
                if (model.layers[static_cast<size_t>(t + first_moe_layer_)].ffn_gate_inp.data == nullptr)
                    throw InvalidArgument(file.where() + "depthtime.gate = 1 but layer " +
                                          std::to_string(t + first_moe_layer_) +
                                          " of the model has no router");
            }
            normed_.assign(static_cast<size_t>(model.hp.n_embd), 0.0f);
            gate_row_.assign(static_cast<size_t>(E), 0.0f);
            gate_prob_.assign(static_cast<size_t>(E), 0.0f);
        }
        ring_.assign(static_cast<size_t>(kVoteWindow * n_layer_ * top_k_), -1);
        hist_.assign(static_cast<size_t>(kDecays.size() * n_layer_ * E), 0.0f);
        seen_count_.assign(static_cast<size_t>(n_layer_ * E), 0.0f);
        overlap_.assign(static_cast<size_t>(kVoteWindow), 0);
        overlap_rows_.assign(static_cast<size_t>(n_layer_ * top_k_), -1);
        member_.assign(static_cast<size_t>(E), 0);
        feature_.assign(static_cast<size_t>(kBase * E), 0.0f);
        reg_prob_.assign(static_cast<size_t>(E), 0.0f);
    }

    const char* name() const override { return "depthtime"; }

    void observe(const PredictorInput& in, std::vector<PrefetchHint>& hints) override {
        if (in.layer == 0) fold_previous_token(in.prev);
        ScoringPredictor::observe(in, hints);
    }

    // A prompt's tokens, as if each had been the previous token of the next (the trace semantics).
    void observe_context(const int32_t* selections, int64_t n_tokens, bool new_sequence) override {
        if (new_sequence) clear_time_state();
        for (int64_t i = 0; i < n_tokens; ++i) append_token(selections + i * n_layer_ * top_k_);
        overlap_layer_ = -1;
    }

    bool predicts(const PredictorInput& in, int d) const override {
        return d >= 1 && d <= max_lookahead_ && in.layer >= 0 && in.layer + d < n_layer_;
    }

    void scores(const PredictorInput& in, int d, float* out) override {
        const int64_t E = n_expert_;
        const int64_t L = in.layer, t = L + d;
        const float* w = stack_.data() + ((d - 1) * n_layer_ + t) * n_features_;
        // The rows needed: a feature with a weight, or a factor of a product with one.
        bool need[kBase] = {};
        bool need_prob = false;
        for (int f = 0; f < kBase; ++f) need[f] = w[f] != 0.0f;
        for (int p = 0; p < kProducts; ++p) {
            if (w[kBase + p] == 0.0f) continue;
            need[kProductOf[p][1]] = true;
            need[kProductOf[p][0] == kRegProb ? kReg : kProductOf[p][0]] = true;
            need_prob = need_prob || kProductOf[p][0] == kRegProb;
        }
        std::fill(feature_.begin(), feature_.end(), 0.0f);
        if (need[kReg]) regression_row(in, t, row(kReg));
        if (need[kCnt]) {
            std::copy(count_bias_.begin() + t * E, count_bias_.begin() + (t + 1) * E, row(kCnt));
            const float* table = count_.data() + (t * max_lookahead_ + (d - 1)) * E * E;
            add_table_rows(table, in.history + L * top_k_, top_k_, E, row(kCnt));
        }
        for (int64_t j = 1; j <= kPrevTokens && j <= n_ring_; ++j)
            if (need[kPrev + j - 1]) add_ids(1.0f, earlier_row(j, t), row(kPrev + static_cast<int>(j) - 1));
        for (int q = 0; q < static_cast<int>(kDecays.size()); ++q)
            if (need[kHist + q]) std::copy_n(hist_.data() + (q * n_layer_ + t) * E, E, row(kHist + q));
        if (need[kFreq] && n_seen_ > 0) {
            const float* seen = seen_count_.data() + t * E;
            for (int64_t e = 0; e < E; ++e) row(kFreq)[e] = seen[e] / static_cast<float>(n_seen_);
        }
        bool any_vote = false;
        for (int f = kVote; f < kNormVote + kVotePowers; ++f) any_vote = any_vote || need[f];
        if (any_vote && n_ring_ > 0) vote_rows(in, t);
        if (need_prob) softmax(row(kReg), reg_prob_.data());
        for (int64_t e = 0; e < E; ++e) out[e] = 0.0f;
        for (int f = 0; f < kBase; ++f)
            if (w[f] != 0.0f) add_scaled(w[f], row(f), out);
        for (int p = 0; p < kProducts; ++p) {
            if (w[kBase + p] == 0.0f) continue;
            const float* x = kProductOf[p][0] == kRegProb ? reg_prob_.data() : row(kProductOf[p][0]);
            const float* y = row(kProductOf[p][1]);
            for (int64_t e = 0; e < E; ++e) out[e] += w[kBase + p] * (x[e] * y[e]);
        }
        if (gate_ && (w[kGate] != 0.0f || w[kGateProb] != 0.0f)) {
            if (in.hidden == nullptr)
                throw InvalidArgument("depthtime: the gate feature needs the hidden state");
            gate_logits(model_, static_cast<int>(t) + first_moe_layer_, false, in.hidden, normed_.data(),
                        gate_row_.data());
            add_scaled(w[kGate], gate_row_.data(), out);
            softmax(gate_row_.data(), gate_prob_.data());
            add_scaled(w[kGateProb], gate_prob_.data(), out);
        }
    }

  private:
    // out += scale * row, E entries.
    void add_scaled(float scale, const float* row, float* out) const {
        for (int64_t e = 0; e < n_expert_; ++e) out[e] += scale * row[e];
    }

    // out[i] += value for each valid id i of ids[0..top_k).
    void add_ids(float value, const int32_t* ids, float* out) const {
        for (int64_t j = 0; j < top_k_; ++j)
            if (ids[j] >= 0 && ids[j] < n_expert_) out[ids[j]] += value;
    }

    // The selections at `layer` of the token j >= 1 steps back (j <= n_ring_).
    const int32_t* earlier_row(int64_t j, int64_t layer) const {
        const int64_t slot = (ring_head_ - j + kVoteWindow) % kVoteWindow;
        return ring_.data() + (slot * n_layer_ + layer) * top_k_;
    }

    // reg of target t into row (E floats).
    void regression_row(const PredictorInput& in, int64_t t, float* row) const {
        const int64_t E = n_expert_;
        std::copy(bias_.begin() + t * E, bias_.begin() + (t + 1) * E, row);
        // Depth: every layer l <= in.layer of this token (all known), at offset t - l.
        for (int64_t l = 0; l <= in.layer; ++l) {
            const float* table = layer_.data() + (t * n_off_ + (t - l - 1)) * E * E;
            add_table_rows(table, in.history + l * top_k_, top_k_, E, row);
        }
        // Time: the previous token at t-1, t, t+1.
        for (int64_t r = -1; r <= 1; ++r) {
            if (t + r < 0 || t + r >= n_layer_) continue;
            const float* table = prev_.data() + (t * kPrevOffsets + (r + 1)) * E * E;
            add_table_rows(table, in.prev + (t + r) * top_k_, top_k_, E, row);
        }
    }

    // overlap_[j-1] = sum_{l<=in.layer} |S(l) ∩ S_{-j}(l)| for j = 1..n_ring_. Extends the cached
    // sums layer by layer while in.history agrees with the rows they were built from; otherwise
    // (another token, or an earlier layer) starts again from layer 0.
    void update_overlaps(const PredictorInput& in) {
        const int64_t L = in.layer;
        bool same = overlap_layer_ >= 0 && overlap_layer_ <= L;
        for (int64_t i = 0; same && i < (overlap_layer_ + 1) * top_k_; ++i)
            same = overlap_rows_[static_cast<size_t>(i)] == in.history[i];
        if (!same) {
            overlap_layer_ = -1;
            std::fill(overlap_.begin(), overlap_.end(), 0);
        }
        for (int64_t l = overlap_layer_ + 1; l <= L; ++l) {
            const int32_t* cur = in.history + l * top_k_;
            for (int64_t i = 0; i < top_k_; ++i)
                if (cur[i] >= 0 && cur[i] < n_expert_) member_[static_cast<size_t>(cur[i])] = 1;
            for (int64_t j = 1; j <= n_ring_; ++j) {
                const int32_t* ids = earlier_row(j, l);
                int32_t shared = 0;
                for (int64_t i = 0; i < top_k_; ++i)
                    if (ids[i] >= 0 && ids[i] < n_expert_) shared += member_[static_cast<size_t>(ids[i])];
                overlap_[static_cast<size_t>(j - 1)] += shared;
            }
            for (int64_t i = 0; i < top_k_; ++i)
                if (cur[i] >= 0 && cur[i] < n_expert_) member_[static_cast<size_t>(cur[i])] = 0;
            std::copy(cur, cur + top_k_, overlap_rows_.begin() + l * top_k_);
        }
        overlap_layer_ = L;
    }

    // vote<p> and nvote<p> rows of target t.
    void vote_rows(const PredictorInput& in, int64_t t) {
        const int64_t E = n_expert_;
        update_overlaps(in);
        float weight_sum[kVotePowers] = {0.0f, 0.0f, 0.0f};
        const float norm = 1.0f / static_cast<float>(top_k_ * (in.layer + 1));
        for (int64_t j = 1; j <= n_ring_; ++j) {
            const float m = static_cast<float>(overlap_[static_cast<size_t>(j - 1)]) * norm;
            const float m2 = m * m, m4 = m2 * m2, m8 = m4 * m4;
            const float power[kVotePowers] = {m, m4, m8 * m8};  // m^1, m^4, m^16
            const int32_t* ids = earlier_row(j, t);
            for (int q = 0; q < kVotePowers; ++q) {
                weight_sum[q] += power[q];
                if (power[q] != 0.0f) add_ids(power[q], ids, row(kVote + q));
            }
        }
        for (int q = 0; q < kVotePowers; ++q) {
            const float scale = 1.0f / std::max(weight_sum[q], 1e-6f);
            for (int64_t e = 0; e < E; ++e) row(kNormVote + q)[e] = row(kVote + q)[e] * scale;
        }
    }

    // prob = softmax of x over the experts (E entries each).
    void softmax(const float* x, float* prob) const {
        const float top = *std::max_element(x, x + n_expert_);
        float sum = 0.0f;
        for (int64_t e = 0; e < n_expert_; ++e) sum += prob[e] = std::exp(x[e] - top);
        for (int64_t e = 0; e < n_expert_; ++e) prob[e] /= sum;
    }

    float* row(int feature) { return feature_.data() + static_cast<int64_t>(feature) * n_expert_; }

    // At layer 0 of a token: the previous token joins the time state, or it is cleared when prev
    // names no expert at all.
    void fold_previous_token(const int32_t* prev) {
        overlap_layer_ = -1;  // another token: its overlaps start again
        bool any = false;
        for (int64_t i = 0; i < n_layer_ * top_k_; ++i) any = any || (prev[i] >= 0 && prev[i] < n_expert_);
        if (any) {
            append_token(prev);
        } else {
            clear_time_state();
        }
    }

    void clear_time_state() {
        std::fill(hist_.begin(), hist_.end(), 0.0f);
        std::fill(seen_count_.begin(), seen_count_.end(), 0.0f);
        n_seen_ = n_ring_ = 0;
    }

    // One more earlier token: ids [n_layer * top_k].
    void append_token(const int32_t* prev) {
        const int64_t E = n_expert_;
        for (size_t q = 0; q < kDecays.size(); ++q)
            for (int64_t l = 0; l < n_layer_; ++l) {
                float* hist = hist_.data() + (q * n_layer_ + l) * E;
                for (int64_t e = 0; e < E; ++e) hist[e] *= kDecays[q];
                add_ids(1.0f, prev + l * top_k_, hist);
            }
        for (int64_t l = 0; l < n_layer_; ++l) add_ids(1.0f, prev + l * top_k_, seen_count_.data() + l * E);
        ++n_seen_;
        std::copy(prev, prev + n_layer_ * top_k_, ring_.begin() + ring_head_ * n_layer_ * top_k_);
        ring_head_ = (ring_head_ + 1) % kVoteWindow;
        n_ring_ = std::min(n_ring_ + 1, kVoteWindow);
    }

    static constexpr int64_t kPrevOffsets = 3;  // previous token's layers t-1, t, t+1
    int64_t n_layer_;
    int max_lookahead_;
    // The gate feature: the model's routers (MoE layer t is model layer t + first_moe_layer_).
    const Model& model_;
    int first_moe_layer_;
    bool gate_;
    int n_features_;                                    // kFeatures, + 2 with the gate
    std::vector<float> normed_, gate_row_, gate_prob_;  // scratch of the gate features
    int64_t n_off_ = 0;                                 // n_layer - 1 offsets o = t - l = 1 .. n_layer-1
    std::vector<float> bias_, layer_, prev_, count_bias_, count_, stack_;
    // Time state: ring_ [kVoteWindow, n_layer, top_k] (the slot before ring_head_ is the previous
    // token; n_ring_ slots are valid), hist_ [4, n_layer, E], seen_count_ [n_layer, E] over n_seen_ tokens.
    std::vector<int32_t> ring_;
    int64_t ring_head_ = 0, n_ring_ = 0, n_seen_ = 0;
    std::vector<float> hist_, seen_count_;
    // The current token's route overlaps with the ring, summed over layers 0..overlap_layer_, and
    // the history rows they were computed from.
    std::vector<int32_t> overlap_, overlap_rows_;
    int64_t overlap_layer_ = -1;
    std::vector<uint8_t> member_;  // scratch: [expert in S(l)], all 0 between uses
    std::vector<float> feature_;   // scratch: the kBase feature rows of one target, [kBase, E]
    std::vector<float> reg_prob_;  // scratch: softmax of the reg row
};

}  // namespace

std::unique_ptr<Predictor> load_depthtime_predictor(const std::string& file, const Model& model,
                                                    int lookahead) {
    SidecarReader reader(file, "depthtime", model, lookahead);
    return std::make_unique<DepthTimePredictor>(reader, model);
}

}  // namespace sharpi
