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
// and, when the sidecar has depthtime.pool = N > 0 (dt.pool: the routes Q_i(l) of N training tokens
// of other sequences, the same retrieval over them; M = depthtime.neighbours):
//     pvote<p> sum_{i in Nb} r_i^p #{slots of Q_i(t) = e} / sum_{i in Nb} r_i^p     p = 4, 16, 64
//     with c_i = sum_{l<=L} #{slots of Q_i(l) in S(l)}, Nb the min(M, N) pool tokens of largest c_i
//     (ties: the lower i), r_i = c_i / max_i c_i (every pvote 0 when that max is 0)
//     reg * pvote<p>, regp * pvote<p>
// and, when the sidecar has depthtime.gate = 1 (trained with the model on a trace with hidden states),
// last:
//     gate     layer t's router applied to ffn_norm_t(hidden_L): next_gate's score (gate_logits)
//     gatep    softmax of gate over the experts
//
// A feature with weight 0 that no weighted product needs is not computed (a target whose training
// kept one feature alone costs only that feature). Expert ids outside [0, E) (the -1 of "unknown")
// are in no set.
//
// State (what the time features need), built from the previous token that observe() sees at layer 0
// of each token and from the tokens observe_context() hands over after a prompt batch: a ring of the
// last kVoteWindow tokens' selections, the four decayed counts and the running counts per layer, and
// the number of tokens seen. A previous token naming no expert at all (a new sequence or a reset
// session) clears it, as does observe_context() with new_sequence. The engine calls observe() for
// every decoded token from layer 0 in order and observe_context() for a batch's tokens
// (docs/design.md §6), so the state covers every token since the last reset, a prompt's included, as
// if each had been decoded alone. scores() only reads that state; the route overlaps m_j of the
// current token are a cache it keeps, checked against in.history on every call (recomputed from
// layer 0 when they differ).
//
// The pool is read once at load into per-(layer, expert) lists of the pool tokens naming that expert
// there (ascending) and an int16 copy of the routes; the f32 tensor is not kept. Its state is a
// cache of the current token alone, kept like the overlaps (extended one layer at a time while
// in.history has the rows it was counted from, else restarted at layer 0; observe() and
// observe_context() leave it alone, since it depends on in.history only): the counts c_i (uint16),
// the list of pool tokens whose count reached a floor that the M-th largest count cannot be below,
// and the neighbours at the last layer counted, with their votes per target once asked. Costs: per
// layer counted, the lists of S(l)'s experts add 1 to their tokens' counts (N top_k^2 / E additions,
// about 45,000 at N = 80,000, top_k = 6, E = 64); per (token, layer), the neighbours are chosen once
// from a histogram of the listed counts (no pass over all N); per target, their votes are tallied
// per distinct count (M top_k additions) and the three rows weighted from those tallies.
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
// With a pool (depthtime.pool > 0) nine more columns follow: pvote<p> for the kPoolPowers powers p,
// then reg * pvote<p>, then regp * pvote<p> (column kFeatures + group * kPoolPowers + q). The gate's
// two optional columns come last, after them.
constexpr int kPoolPowers = 3, kPoolFeatures = 3 * kPoolPowers;  // p = 4, 16, 64
constexpr int kPoolVote = kBase;  // the pvote rows in feature_, after the kBase ones
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
          n_pool_(file.uint_key_or("depthtime.pool", 0, 0, kMaxPool)),
          gate_col_(kFeatures + (n_pool_ > 0 ? kPoolFeatures : 0)),
          n_features_(gate_col_ + (gate_ ? 2 : 0)) {
        const int64_t E = n_expert_;
        n_off_ = n_layer_ > 1 ? n_layer_ - 1 : 1;
        const int64_t neighbours = file.uint_key_or("depthtime.neighbours", 0, 0, kMaxPool);
        if (n_pool_ > 0 && neighbours < 1)
            throw FormatError(file.where() + "metadata key 'sharpi.predictor.depthtime.neighbours' = " +
                              std::to_string(neighbours) +
                              " with depthtime.pool = " + std::to_string(n_pool_) + ", expected >= 1");
        n_neighbours_ = std::min(neighbours, n_pool_);
        if (n_pool_ > 0) load_pool(file);
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
        feature_.assign(static_cast<size_t>((kBase + kPoolPowers) * E), 0.0f);
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
        const float* w = stack_row(d, t);
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
        // The pool votes (none without a pool) and the reg / regp factors of their products.
        const bool need_pool = needs_pool(w);
        for (int q = 0; need_pool && q < kPoolPowers; ++q) {
            const float* pw = w + kFeatures + q;  // pvote, reg * pvote, regp * pvote of power q
            need[kReg] = need[kReg] || pw[kPoolPowers] != 0.0f || pw[2 * kPoolPowers] != 0.0f;
            need_prob = need_prob || pw[2 * kPoolPowers] != 0.0f;
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
        if (need_pool) pool_vote_rows(in, d);
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
        for (int q = 0; need_pool && q < kPoolPowers; ++q) {
            const float* vote = row(kPoolVote + q);
            const float* pw = w + kFeatures + q;
            if (pw[0] != 0.0f) add_scaled(pw[0], vote, out);
            const float* reg = row(kReg);
            if (pw[kPoolPowers] != 0.0f)
                for (int64_t e = 0; e < E; ++e) out[e] += pw[kPoolPowers] * (reg[e] * vote[e]);
            if (pw[2 * kPoolPowers] != 0.0f)
                for (int64_t e = 0; e < E; ++e) out[e] += pw[2 * kPoolPowers] * (reg_prob_[e] * vote[e]);
        }
        const int gate = gate_col_, gate_prob = gate_col_ + 1;
        if (gate_ && (w[gate] != 0.0f || w[gate_prob] != 0.0f)) {
            if (in.hidden == nullptr)
                throw InvalidArgument("depthtime: the gate feature needs the hidden state");
            gate_logits(model_, static_cast<int>(t) + first_moe_layer_, false, in.hidden, normed_.data(),
                        gate_row_.data());
            add_scaled(w[gate], gate_row_.data(), out);
            softmax(gate_row_.data(), gate_prob_.data());
            add_scaled(w[gate_prob], gate_prob_.data(), out);
        }
    }

  private:
    // The stacker's weights of target t at distance d: n_features_ floats.
    const float* stack_row(int d, int64_t t) const {
        return stack_.data() + ((d - 1) * n_layer_ + t) * n_features_;
    }

    // Whether weights w (a stack row) need the pool votes: pvote<p> or a product of one has a weight.
    bool needs_pool(const float* w) const {
        bool any = false;
        for (int c = kFeatures; n_pool_ > 0 && c < kFeatures + kPoolFeatures; ++c) any = any || w[c] != 0.0f;
        return any;
    }

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

    // Whether a cache of the current token built from its rows of layers 0..built (`rows`, built = -1:
    // nothing yet) still holds for `in`: built <= in.layer and in.history has those rows. Then the
    // cache extends layer by layer up to in.layer; otherwise (another token, or an earlier layer) it
    // starts again from layer 0.
    bool extends(const std::vector<int32_t>& rows, int64_t built, const PredictorInput& in) const {
        return built >= 0 && built <= in.layer &&
               std::equal(rows.begin(), rows.begin() + (built + 1) * top_k_, in.history);
    }

    // overlap_[j-1] = sum_{l<=in.layer} |S(l) ∩ S_{-j}(l)| for j = 1..n_ring_, kept as extends() says.
    void update_overlaps(const PredictorInput& in) {
        const int64_t L = in.layer;
        if (!extends(overlap_rows_, overlap_layer_, in)) {
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

    // dt.pool [N, n_layer, top_k] (expert ids as f32, -1 unknown) into pool_route_ and the postings;
    // the float copy goes away with this frame.
    void load_pool(const SidecarReader& file) {
        const int64_t E = n_expert_, N = n_pool_, K = top_k_;
        if (K * n_layer_ > UINT16_MAX || E > INT16_MAX)
            throw InvalidArgument(file.where() +
                                  "the pool keeps expert ids and route matches in 16 bits: n_expert = " +
                                  std::to_string(E) + ", top_k * n_layer = " + std::to_string(K * n_layer_));
        const std::vector<float> pool = file.tensor("dt.pool", {N, n_layer_, K});
        pool_route_.assign(pool.size(), -1);
        posting_start_.assign(static_cast<size_t>(n_layer_ * E + 1), 0);
        for (size_t c = 0; c < pool.size(); ++c) {
            const float v = pool[c];
            if (!(v >= -1.0f && v < static_cast<float>(E) && v == std::trunc(v))) {
                const int64_t i = static_cast<int64_t>(c) / (n_layer_ * K),
                              l = static_cast<int64_t>(c) / K % n_layer_;
                throw FormatError(file.where() + "tensor 'dt.pool' holds " + std::to_string(v) + " at [" +
                                  std::to_string(i) + ", " + std::to_string(l) + ", " +
                                  std::to_string(static_cast<int64_t>(c) % K) +
                                  "], expected an expert id in -1.." + std::to_string(E - 1));
            }
            pool_route_[c] = static_cast<int16_t>(v);
            const int64_t l = static_cast<int64_t>(c) / K % n_layer_;
            if (v >= 0.0f) ++posting_start_[static_cast<size_t>(l * E + pool_route_[c] + 1)];
        }
        for (size_t c = 1; c < posting_start_.size(); ++c) posting_start_[c] += posting_start_[c - 1];
        posting_.resize(static_cast<size_t>(posting_start_.back()));
        std::vector<int64_t> next(posting_start_.begin(), posting_start_.end() - 1);
        for (int64_t i = 0; i < N; ++i)  // i ascending: each list comes out sorted
            for (int64_t l = 0; l < n_layer_; ++l)
                for (int64_t j = 0; j < K; ++j) {
                    const int16_t id = pool_route_[static_cast<size_t>((i * n_layer_ + l) * K + j)];
                    if (id >= 0)
                        posting_[static_cast<size_t>(next[static_cast<size_t>(l * E + id)]++)] =
                            static_cast<uint32_t>(i);
                }
        pool_count_.assign(static_cast<size_t>(N), 0);
        pool_rows_.assign(static_cast<size_t>(n_layer_ * K), -1);
        pool_high_.assign(static_cast<size_t>(N + 1), 0);
        count_hist_.assign(static_cast<size_t>(kHistCopies * (K * n_layer_ + 1)), 0);
        take_bits_.assign(static_cast<size_t>((N + 63) / 64), 0);
        tie_bits_.assign(take_bits_.size(), 0);
        neighbour_.assign(static_cast<size_t>(n_neighbours_), 0);
        neighbour_group_.assign(static_cast<size_t>(n_neighbours_), 0);
    }

    // pool_count_[i] = c_i = sum_{l<=in.layer} (slots of pool token i's route at l naming an expert of
    // S(l)), kept as extends() says: a layer adds, for each distinct expert e of S(l), 1 to every
    // entry of e's posting list at l (a pool token whose route names e twice is in it twice). A count
    // that reaches pool_floor_ puts its token on pool_high_.
    void update_pool_counts(const PredictorInput& in) {
        const int64_t L = in.layer;
        if (!extends(pool_rows_, pool_layer_, in)) {
            pool_layer_ = -1;
            pool_floor_ = kFirstFloor;
            n_high_ = 0;
            std::fill(pool_count_.begin(), pool_count_.end(), 0);
        }
        const uint16_t floor = static_cast<uint16_t>(pool_floor_);
        uint16_t* count = pool_count_.data();
        uint32_t* high = pool_high_.data();
        for (int64_t l = pool_layer_ + 1; l <= L; ++l) {
            const int32_t* cur = in.history + l * top_k_;
            for (int64_t j = 0; j < top_k_; ++j) {
                const int32_t e = cur[j];
                if (e < 0 || e >= n_expert_ || member_[static_cast<size_t>(e)]) continue;
                member_[static_cast<size_t>(e)] = 1;
                const size_t list = static_cast<size_t>(l * n_expert_ + e);
                const uint32_t* end = posting_.data() + posting_start_[list + 1];
                // Branch-free (whether a count reaches the floor is a coin toss near it): every token is
                // written, and kept when it does; high has a spare slot after N for the last write.
                int64_t n_high = n_high_;
                for (const uint32_t* i = posting_.data() + posting_start_[list]; i != end; ++i) {
                    high[n_high] = *i;
                    n_high += ++count[*i] == floor;
                }
                n_high_ = n_high;
            }
            for (int64_t j = 0; j < top_k_; ++j)
                if (cur[j] >= 0 && cur[j] < n_expert_) member_[static_cast<size_t>(cur[j])] = 0;
            std::copy(cur, cur + top_k_, pool_rows_.begin() + l * top_k_);
            neighbour_layer_ = -1;
        }
        pool_layer_ = L;
    }

    // The neighbours of the counts at pool_layer_: the n_neighbours_ pool tokens of largest count, ties
    // to the lower index, in index order, with their weights r^p (r = c_i / max c). Only pool_high_ is
    // looked at: a count below pool_floor_ is 0 (weighs nothing in any sum) or below an earlier
    // layer's n_neighbours_-th largest count, which this layer's cannot be below (counts only grow).
    // A histogram of the pool_high_ counts gives c*, the n_neighbours_-th largest; pool_high_ drops
    // the counts below it (the new floor). Counts > c* are taken, ties at c* in index order until
    // n_neighbours_ are taken (bitsets over the pool make the index order without a sort).
    void select_neighbours() {
        if (neighbour_layer_ == pool_layer_) return;
        neighbour_layer_ = pool_layer_;
        const uint16_t* count = pool_count_.data();
        uint32_t* high = pool_high_.data();
        const size_t hist_size =
            static_cast<size_t>(top_k_ * n_layer_ + 1);  // no count exceeds top_k * n_layer
        if (n_high_ < n_neighbours_ && pool_floor_ > 1) {
            // Too few counts reach a first floor above 1: all counts >= 1 are candidates (then all
            // neighbours). Rare: the floor of a new token's first layer is a guess.
            pool_floor_ = 1;
            n_high_ = 0;
            for (int64_t i = 0; i < n_pool_; ++i) {
                high[n_high_] = static_cast<uint32_t>(i);
                n_high_ += count[i] >= 1;
            }
        }
        std::fill(count_hist_.begin(), count_hist_.end(), 0);
        for (int64_t k = 0; k < n_high_; ++k)  // copies: no chain of increments of one bin
            ++count_hist_[static_cast<size_t>(k % kHistCopies) * hist_size + count[high[k]]];
        // c* = the largest count with >= n_neighbours_ tokens at or above it, `above` of them above it.
        int64_t above = 0, tied = 0;
        int threshold = pool_floor_, most = 0;
        for (int c = static_cast<int>(hist_size) - 1; c >= pool_floor_; --c) {
            tied = 0;
            for (size_t k = 0; k < kHistCopies; ++k)
                tied += count_hist_[k * hist_size + static_cast<size_t>(c)];
            if (tied > 0 && most == 0) most = c;
            threshold = c;
            if (above + tied >= n_neighbours_) break;
            above += tied;
        }
        // Fewer than n_neighbours_ counts >= 1 (pool_floor_ is then 1): every one is a neighbour.
        int64_t ties = std::min(tied, n_neighbours_ - above);
        if (n_high_ < n_neighbours_) threshold = pool_floor_, ties = tied;
        // Branch-free: a kept token's bit goes to take_bits_ (count > c*, or a tie when all ties are
        // taken) or to tie_bits_ (a tie to choose among).
        const bool choose = ties < tied;
        int64_t kept = 0;
        for (int64_t k = 0; k < n_high_; ++k) {
            const uint32_t i = high[k];
            const int c = count[i];
            high[kept] = i;
            kept += c >= threshold;
            const uint64_t bit = uint64_t{1} << (i % 64);
            take_bits_[i / 64] |= (c > threshold || (c == threshold && !choose)) ? bit : 0;
            tie_bits_[i / 64] |= (c == threshold && choose) ? bit : 0;
        }
        n_high_ = kept;
        pool_floor_ = threshold;
        // The neighbours in index order, each with its count's group g = most - c (the same weight).
        n_neighbour_ = 0;
        const int groups = most - threshold + 1;
        std::fill(std::begin(neighbour_total_), std::end(neighbour_total_), 0.0f);
        if (most == 0) return;  // no pool token shares an expert with this one
        for (size_t word = 0; word < take_bits_.size(); ++word) {
            uint64_t take = take_bits_[word], tie = tie_bits_[word];
            if ((take | tie) == 0) continue;
            take_bits_[word] = tie_bits_[word] = 0;
            for (; tie != 0 && ties > 0; --ties, tie &= tie - 1) take |= tie & (0 - tie);  // lowest first
            for (; take != 0; take &= take - 1) {
                const uint32_t i =
                    static_cast<uint32_t>(word * 64 + static_cast<size_t>(__builtin_ctzll(take)));
                neighbour_[static_cast<size_t>(n_neighbour_)] = i;
                neighbour_group_[static_cast<size_t>(n_neighbour_++)] =
                    static_cast<uint16_t>(most - count[i]);
            }
        }
        // r = c / most, r^4 = (r^2)^2, r^16 = (r^4)^4, r^64 = (r^16)^4, in float.
        group_weight_.assign(static_cast<size_t>(groups * kPoolPowers), 0.0f);
        for (int g = 0; g < groups; ++g) {
            const float r = static_cast<float>(most - g) / static_cast<float>(most);
            const float r2 = r * r, r4 = r2 * r2, r8 = r4 * r4, r16 = r8 * r8, r32 = r16 * r16;
            const float weight[kPoolPowers] = {r4, r16, r32 * r32};
            for (int q = 0; q < kPoolPowers; ++q)
                group_weight_[static_cast<size_t>(g * kPoolPowers + q)] = weight[q];
        }
        for (int64_t k = 0; k < n_neighbour_; ++k)
            for (int q = 0; q < kPoolPowers; ++q)
                neighbour_total_[q] += group_weight_[static_cast<size_t>(
                    neighbour_group_[static_cast<size_t>(k)] * kPoolPowers + q)];
        group_tally_.assign(static_cast<size_t>(max_lookahead_ * groups * n_expert_), 0);
        tallied_ = 0;
    }

    // group_tally_[d-1][g][e] = the neighbours of group g whose route names e at pool_layer_ + d
    // (once per d and neighbours).
    const int32_t* tally(int d) {
        const int64_t E = n_expert_, groups = static_cast<int64_t>(group_weight_.size()) / kPoolPowers;
        int32_t* out = group_tally_.data() + (d - 1) * groups * E;
        if (tallied_ & (1u << d)) return out;
        tallied_ |= 1u << d;
        const int64_t stride = n_layer_ * top_k_;
        const int16_t* first = pool_route_.data() + (pool_layer_ + d) * top_k_;  // pool token 0's at L + d
        for (int64_t k = 0; k < n_neighbour_; ++k) {
            // The rows are scattered over the pool: ask for one a few neighbours ahead.
            if (k + kPrefetch < n_neighbour_)
                __builtin_prefetch(first + neighbour_[static_cast<size_t>(k + kPrefetch)] * stride);
            const int16_t* ids = first + neighbour_[static_cast<size_t>(k)] * stride;
            int32_t* group = out + neighbour_group_[static_cast<size_t>(k)] * E;
            for (int64_t j = 0; j < top_k_; ++j)
                if (ids[j] >= 0) ++group[ids[j]];
        }
        return out;
    }

    // pvote<p> rows of target L + d: each neighbour votes r^p for its experts there, over the sum of
    // r^p (>= 1: the best neighbour has r = 1). All 0 when no pool token shares an expert with S.
    void pool_vote_rows(const PredictorInput& in, int d) {
        update_pool_counts(in);
        select_neighbours();
        if (n_neighbour_ == 0) return;
        const int64_t E = n_expert_, groups = static_cast<int64_t>(group_weight_.size()) / kPoolPowers;
        const int32_t* counts = tally(d);
        for (int q = 0; q < kPoolPowers; ++q) {
            float* vote = row(kPoolVote + q);
            const float scale = 1.0f / neighbour_total_[q];
            for (int64_t g = 0; g < groups; ++g) {
                const float weight = group_weight_[static_cast<size_t>(g * kPoolPowers + q)] * scale;
                for (int64_t e = 0; e < E; ++e) vote[e] += weight * static_cast<float>(counts[g * E + e]);
            }
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

    static constexpr int64_t kPrevOffsets = 3;       // previous token's layers t-1, t, t+1
    static constexpr int64_t kMaxPool = 50'000'000;  // depthtime.pool and .neighbours at most
    static constexpr int64_t kPrefetch = 16;         // neighbours ahead whose route rows are asked for
    static constexpr size_t kHistCopies = 4;         // interleaved copies of the count histogram
    // pool_floor_ of a new token: at its first layer a count is the 0..top_k slots it shares, and
    // most pool tokens share one with any route; starting the floor at 2 keeps them off pool_high_.
    static constexpr int kFirstFloor = 2;
    int64_t n_layer_;
    int max_lookahead_;
    // The gate feature: the model's routers (MoE layer t is model layer t + first_moe_layer_).
    const Model& model_;
    int first_moe_layer_;
    bool gate_;
    int64_t n_pool_;            // N pool tokens (0: no pool votes)
    int gate_col_;              // the gate's first column
    int n_features_;            // kFeatures, + kPoolFeatures with a pool, + 2 with the gate
    int64_t n_neighbours_ = 0;  // min(depthtime.neighbours, N)
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
    // The pool (fixed after load): pool_route_ [N, n_layer, top_k] (-1 unknown), and per (layer,
    // expert) the pool tokens whose route names that expert there, ascending:
    // posting_[posting_start_[l * E + e] .. posting_start_[l * E + e + 1]).
    std::vector<int16_t> pool_route_;
    std::vector<int64_t> posting_start_;
    std::vector<uint32_t> posting_;
    // The current token's route matches with the pool: pool_count_ [N] over its layers
    // 0..pool_layer_ (the rows pool_rows_); pool_high_[0..n_high_) holds exactly the pool tokens of
    // count >= pool_floor_, in no particular order (one spare slot after N). pool_floor_ is
    // kFirstFloor for a new token, then the n_neighbours_-th largest count when last selected (1 when
    // fewer counts than that are >= 1).
    std::vector<uint16_t> pool_count_;
    std::vector<int32_t> pool_rows_;
    int64_t pool_layer_ = -1;
    int pool_floor_ = kFirstFloor;
    std::vector<uint32_t> pool_high_;
    int64_t n_high_ = 0;
    // The neighbours of those counts (built at neighbour_layer_ = pool_layer_; -1: stale, as every
    // layer counted makes them, a new token's included):
    // neighbour_[0..n_neighbour_) in index order, neighbour_group_ their g = max count - count;
    // group_weight_ [groups, kPoolPowers] r^p of each group, neighbour_total_ the sums over them.
    std::vector<uint32_t> neighbour_;
    std::vector<uint16_t> neighbour_group_;
    int64_t n_neighbour_ = 0;
    std::vector<float> group_weight_;
    float neighbour_total_[kPoolPowers] = {};
    std::vector<int32_t> group_tally_;  // [max_lookahead, groups, E]: tally(d) for the d in tallied_
    unsigned tallied_ = 0;              // bit d: group_tally_[d-1] is done
    int64_t neighbour_layer_ = -1;
    // Scratch of select_neighbours(): count_hist_ [kHistCopies, top_k * n_layer + 1] the counts of
    // pool_high_; take_bits_, tie_bits_ [ceil(N / 64)] the tokens taken / tied at c*, all 0 between
    // uses.
    std::vector<uint32_t> count_hist_;
    std::vector<uint64_t> take_bits_, tie_bits_;
    std::vector<uint8_t> member_;  // scratch: [expert in S(l)], all 0 between uses
    std::vector<float> feature_;   // scratch: the kBase + kPoolPowers feature rows of one target, [.., E]
    std::vector<float> reg_prob_;  // scratch: softmax of the reg row
};

}  // namespace

std::unique_ptr<Predictor> load_depthtime_predictor(const std::string& file, const Model& model,
                                                    int lookahead) {
    SidecarReader reader(file, "depthtime", model, lookahead);
    return std::make_unique<DepthTimePredictor>(reader, model);
}

}  // namespace sharpi
