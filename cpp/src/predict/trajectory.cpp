// trajectory: a tiny transformer over the last up-to-W layers' expert choices (docs/predictors.md,
// "trajectory"; the ExpertTransformer of the seed paper).
//
// Sequence for source layer L (n = min(W, L+1) + 1 positions, oldest first):
//     x_j    = layer_emb[s] + sum_{i in S(s)} expert_emb[s, i]        s = L-n+2 .. L
//     x_last = prev_none                                               no previous token
//            = sum_{d=1..max_lookahead, L+d < n_layer} sum_{i in P(L+d)} prev_emb[L+d, i]
// then n_block pre-LayerNorm blocks (full attention, no mask; exact erf GELU), y = LN_f(x) at the
// position of layer L (index n-2), and score_{L+d} = head.d.w[L+d] @ y + head.d.b[L+d].
//
// "No previous token" means every entry of `prev` is negative (the engine passes all -1 then).
// Expert ids outside [0, E) contribute nothing.
//
// Owns copies of every weight and the scratch buffers (sized for W+1 positions at load; scores()
// never allocates). State between calls: y of the last input key (layer, the window's history rows,
// whether there is a previous token and the prev rows x_last reads), so the d = 1..lookahead calls
// of one observe() run the transformer once. The key is the ids themselves, never an address.
//
// Only y at position n-2 is needed, so the last block computes keys and values for every position
// but the query, attention output and MLP for that one position only. Matrix products go through
// cpu::dot_f32_tile (chosen by CPUID at load), so this file needs no ISA flags.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>

#include "cpu/quant/kernels.h"
#include "predict/predictor.h"
#include "predict/sidecar.h"
#include "sharpi/errors.h"

namespace sharpi {

namespace {

struct TrajectoryBlock {
    std::vector<float> ln1_w, ln1_b;    // [D]
    std::vector<float> qkv_w, qkv_b;    // [3D, D], [3D]: rows q | k | v, heads contiguous within each
    std::vector<float> out_w, out_b;    // [D, D], [D]
    std::vector<float> ln2_w, ln2_b;    // [D]
    std::vector<float> up_w, up_b;      // [F, D], [F]
    std::vector<float> down_w, down_b;  // [D, F], [D]
};

constexpr float kLayerNormEps = 1e-5f;

class TrajectoryPredictor final : public ScoringPredictor {
  public:
    explicit TrajectoryPredictor(const SidecarReader& file)
        : ScoringPredictor(file.header().n_expert, file.header().top_k),
          n_layer_(file.header().n_layer),
          max_lookahead_(file.header().max_lookahead),
          dot_(cpu::dot_f32_kernel(cpu::active_isa())),
          dot_tile_(cpu::dot_f32_tile_kernel(cpu::active_isa())) {
        window_ = file.uint_key("trajectory.window", 1, 10);
        d_model_ = file.uint_key("trajectory.d_model", 1, 1 << 16);
        const int64_t n_block = file.uint_key("trajectory.n_block", 1, 64);
        n_head_ = file.uint_key("trajectory.n_head", 1, d_model_);
        d_ff_ = file.uint_key("trajectory.d_ff", 1, 1 << 20);
        if (d_model_ % n_head_ != 0) {
            throw FormatError(file.where() + "trajectory.d_model=" + std::to_string(d_model_) +
                              " is not a multiple of trajectory.n_head=" + std::to_string(n_head_));
        }
        const int64_t D = d_model_, E = n_expert_, F = d_ff_;
        expert_emb_ = file.tensor("traj.expert_emb", {n_layer_, E, D});
        layer_emb_ = file.tensor("traj.layer_emb", {n_layer_, D});
        prev_emb_ = file.tensor("traj.prev_emb", {n_layer_, E, D});
        prev_none_ = file.tensor("traj.prev_none", {D});
        blocks_.resize(static_cast<size_t>(n_block));
        for (int64_t b = 0; b < n_block; ++b) {
            TrajectoryBlock& blk = blocks_[static_cast<size_t>(b)];
            const std::string p = "traj.blk." + std::to_string(b) + ".";
            blk.ln1_w = file.tensor(p + "ln1.w", {D});
            blk.ln1_b = file.tensor(p + "ln1.b", {D});
            blk.qkv_w = file.tensor(p + "qkv.w", {3 * D, D});
            blk.qkv_b = file.tensor(p + "qkv.b", {3 * D});
            blk.out_w = file.tensor(p + "out.w", {D, D});
            blk.out_b = file.tensor(p + "out.b", {D});
            blk.ln2_w = file.tensor(p + "ln2.w", {D});
            blk.ln2_b = file.tensor(p + "ln2.b", {D});
            blk.up_w = file.tensor(p + "up.w", {F, D});
            blk.up_b = file.tensor(p + "up.b", {F});
            blk.down_w = file.tensor(p + "down.w", {D, F});
            blk.down_b = file.tensor(p + "down.b", {D});
        }
        ln_f_w_ = file.tensor("traj.ln_f.w", {D});
        ln_f_b_ = file.tensor("traj.ln_f.b", {D});
        for (int d = 1; d <= max_lookahead_; ++d) {
            head_w_.push_back(file.tensor("traj.head." + std::to_string(d) + ".w", {n_layer_, E, D}));
            head_b_.push_back(file.tensor("traj.head." + std::to_string(d) + ".b", {n_layer_, E}));
        }

        const size_t n_pos = static_cast<size_t>(window_ + 1);
        x_.resize(n_pos * static_cast<size_t>(D));
        h_.resize(n_pos * static_cast<size_t>(D));
        qkv_.resize(n_pos * static_cast<size_t>(3 * D));
        att_.resize(n_pos * static_cast<size_t>(D));
        logits_.resize(n_pos * n_pos);
        ff_.resize(n_pos * static_cast<size_t>(F));
        y_.resize(static_cast<size_t>(D));
        ones_.assign(static_cast<size_t>(std::max(D, F)), 1.0f);
        const size_t key_capacity = 2 + static_cast<size_t>((window_ + max_lookahead_) * top_k_);
        key_.resize(key_capacity);
        cached_key_.resize(key_capacity);
    }

    const char* name() const override { return "trajectory"; }

    bool predicts(const PredictorInput& in, int d) const override {
        return d >= 1 && d <= max_lookahead_ && in.layer >= 0 && in.layer + d < n_layer_;
    }

    void scores(const PredictorInput& in, int d, float* out) override {
        const size_t key_len = make_key(in);
        if (key_len != cached_key_len_ ||
            !std::equal(key_.begin(), key_.begin() + static_cast<ptrdiff_t>(key_len), cached_key_.begin())) {
            forward(in);
            std::copy(key_.begin(), key_.begin() + static_cast<ptrdiff_t>(key_len), cached_key_.begin());
            cached_key_len_ = key_len;
        }
        const int64_t E = n_expert_, D = d_model_;
        const int64_t t = in.layer + d;
        const std::vector<float>& head_w = head_w_[static_cast<size_t>(d - 1)];
        const std::vector<float>& head_b = head_b_[static_cast<size_t>(d - 1)];
        dot_tile_(head_w.data() + t * E * D, D, E, y_.data(), D, 1, D, out, E);
        for (int64_t e = 0; e < E; ++e) out[e] += head_b[static_cast<size_t>(t * E + e)];
    }

  private:
    int64_t window_len(int64_t layer) const { return std::min(window_, layer + 1); }

    bool has_prev(const PredictorInput& in) const {
        const int32_t* prev = in.prev;
        for (int64_t i = 0; i < n_layer_ * top_k_; ++i)
            if (prev[i] >= 0) return true;
        return false;
    }

    // Everything y depends on, into key_; returns its length.
    size_t make_key(const PredictorInput& in) {
        size_t n = 0;
        const int64_t L = in.layer;
        const bool prev = has_prev(in);
        key_[n++] = static_cast<int32_t>(L);
        key_[n++] = prev ? 1 : 0;
        const int64_t n_win = window_len(L);
        for (int64_t s = L - n_win + 1; s <= L; ++s)
            for (int64_t j = 0; j < top_k_; ++j) key_[n++] = in.history[s * top_k_ + j];
        if (prev) {
            for (int64_t t = L + 1; t <= L + max_lookahead_ && t < n_layer_; ++t)
                for (int64_t j = 0; j < top_k_; ++j) key_[n++] = in.prev[t * top_k_ + j];
        }
        return n;
    }

    // dst += table[i] (rows of D) for each valid id i of the top_k ids.
    void add_embeddings(const float* table, const int32_t* ids, float* dst) const {
        const int64_t D = d_model_;
        for (int64_t j = 0; j < top_k_; ++j) {
            const int32_t i = ids[j];
            if (i < 0 || i >= n_expert_) continue;
            const float* row = table + static_cast<int64_t>(i) * D;
            for (int64_t c = 0; c < D; ++c) dst[c] += row[c];
        }
    }

    void layer_norm(const float* x, const std::vector<float>& w, const std::vector<float>& b,
                    float* out) const {
        const int64_t D = d_model_;
        const float mean = dot_(x, ones_.data(), D) / static_cast<float>(D);
        for (int64_t c = 0; c < D; ++c) out[c] = x[c] - mean;
        const float var = dot_(out, out, D) / static_cast<float>(D);
        const float inv_std = 1.0f / std::sqrt(var + kLayerNormEps);
        for (int64_t c = 0; c < D; ++c) out[c] = out[c] * inv_std * w[c] + b[c];
    }

    // Fills y_ for in.layer (see the file comment).
    void forward(const PredictorInput& in) {
        const int64_t D = d_model_, F = d_ff_, E = n_expert_;
        const int64_t L = in.layer;
        const int64_t n_win = window_len(L);
        const int64_t n = n_win + 1;
        const int64_t q_pos = n_win - 1;  // the position of layer L itself

        for (int64_t j = 0; j < n_win; ++j) {
            const int64_t s = L - n_win + 1 + j;
            float* row = x_.data() + j * D;
            std::copy_n(layer_emb_.data() + s * D, D, row);
            add_embeddings(expert_emb_.data() + s * E * D, in.history + s * top_k_, row);
        }
        float* last = x_.data() + n_win * D;
        if (has_prev(in)) {
            std::fill_n(last, D, 0.0f);
            for (int64_t t = L + 1; t <= L + max_lookahead_ && t < n_layer_; ++t)
                add_embeddings(prev_emb_.data() + t * E * D, in.prev + t * top_k_, last);
        } else {
            std::copy_n(prev_none_.data(), D, last);
        }

        for (size_t b = 0; b < blocks_.size(); ++b) {
            const TrajectoryBlock& blk = blocks_[b];
            const bool final_block = b + 1 == blocks_.size();
            // Rows whose output is still needed: all of them, except in the final block.
            const int64_t first = final_block ? q_pos : 0;
            const int64_t n_rows = final_block ? 1 : n;

            for (int64_t j = 0; j < n; ++j)
                layer_norm(x_.data() + j * D, blk.ln1_w, blk.ln1_b, h_.data() + j * D);
            // keys and values of every position; queries of the needed rows only.
            dot_tile_(blk.qkv_w.data() + D * D, D, 2 * D, h_.data(), D, n, D, qkv_.data() + D, 3 * D);
            dot_tile_(blk.qkv_w.data(), D, D, h_.data() + first * D, D, n_rows, D,
                      qkv_.data() + first * 3 * D, 3 * D);
            for (int64_t j = 0; j < n; ++j) {
                float* r = qkv_.data() + j * 3 * D;
                const bool with_q = j >= first && j < first + n_rows;
                for (int64_t c = with_q ? 0 : D; c < 3 * D; ++c) r[c] += blk.qkv_b[static_cast<size_t>(c)];
            }
            attention(first, n_rows, n);

            // x += att @ out.w^T + out.b (h_ is free again and holds the product).
            dot_tile_(blk.out_w.data(), D, D, att_.data() + first * D, D, n_rows, D, h_.data() + first * D,
                      D);
            for (int64_t j = first; j < first + n_rows; ++j) {
                float* xr = x_.data() + j * D;
                const float* pr = h_.data() + j * D;
                for (int64_t c = 0; c < D; ++c) xr[c] += pr[c] + blk.out_b[static_cast<size_t>(c)];
            }

            // x += gelu(LN2(x) @ up.w^T + up.b) @ down.w^T + down.b
            for (int64_t j = first; j < first + n_rows; ++j)
                layer_norm(x_.data() + j * D, blk.ln2_w, blk.ln2_b, h_.data() + j * D);
            dot_tile_(blk.up_w.data(), D, F, h_.data() + first * D, D, n_rows, D, ff_.data() + first * F, F);
            for (int64_t j = first; j < first + n_rows; ++j) {
                float* fr = ff_.data() + j * F;
                for (int64_t c = 0; c < F; ++c) fr[c] = gelu(fr[c] + blk.up_b[static_cast<size_t>(c)]);
            }
            dot_tile_(blk.down_w.data(), F, D, ff_.data() + first * F, F, n_rows, F, h_.data() + first * D,
                      D);
            for (int64_t j = first; j < first + n_rows; ++j) {
                float* xr = x_.data() + j * D;
                const float* pr = h_.data() + j * D;
                for (int64_t c = 0; c < D; ++c) xr[c] += pr[c] + blk.down_b[static_cast<size_t>(c)];
            }
        }
        layer_norm(x_.data() + q_pos * D, ln_f_w_, ln_f_b_, y_.data());
    }

    // att_[rows first .. first+n_rows) = softmax(q k^T / sqrt(hd)) v per head, over all n positions.
    void attention(int64_t first, int64_t n_rows, int64_t n) {
        const int64_t D = d_model_, hd = d_model_ / n_head_;
        const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
        for (int64_t hh = 0; hh < n_head_; ++hh) {
            const float* q = qkv_.data() + hh * hd;
            const float* k = qkv_.data() + D + hh * hd;
            const float* v = qkv_.data() + 2 * D + hh * hd;
            // logits_[r * n + j] = q_{first+r} . k_j
            dot_tile_(k, 3 * D, n, q + first * 3 * D, 3 * D, n_rows, hd, logits_.data(), n);
            for (int64_t r = 0; r < n_rows; ++r) {
                float* p = logits_.data() + r * n;
                float max_logit = p[0] * scale;
                for (int64_t j = 0; j < n; ++j) {
                    p[j] *= scale;
                    max_logit = std::max(max_logit, p[j]);
                }
                float sum = 0.0f;
                for (int64_t j = 0; j < n; ++j) {
                    p[j] = std::exp(p[j] - max_logit);
                    sum += p[j];
                }
                const float inv_sum = 1.0f / sum;
                float* o = att_.data() + (first + r) * D + hh * hd;
                std::fill_n(o, hd, 0.0f);
                for (int64_t j = 0; j < n; ++j) {
                    const float w = p[j] * inv_sum;
                    const float* vj = v + j * 3 * D;
                    for (int64_t c = 0; c < hd; ++c) o[c] += w * vj[c];
                }
            }
        }
    }

    // Exact (erf) GELU. std::erf costs ~13 ns a call and does not vectorise, which alone was a
    // third of the call budget (3k calls), so erf is Abramowitz & Stegun 7.1.28:
    //     erf(a) = 1 - (1 + a1 a + ... + a6 a^6)^-16,  a = |x|,  |error| <= 3e-7 in exact arithmetic
    // (measured in f32: <= 1.7e-6 for erf, <= 9e-7 absolute for gelu). Branch-free (fabs, copysign)
    // so the loop vectorises; for a > ~8.3 the power overflows to inf and erf is exactly +-1.
    static float erf_approx(float x) {
        const float a = std::fabs(x);
        float p = 0.0000430638f;
        p = p * a + 0.0002765672f;
        p = p * a + 0.0001520143f;
        p = p * a + 0.0092705272f;
        p = p * a + 0.0422820123f;
        p = p * a + 0.0705230784f;
        p = p * a + 1.0f;
        p = p * p;  // ^2
        p = p * p;  // ^4
        p = p * p;  // ^8
        p = p * p;  // ^16
        return std::copysign(1.0f - 1.0f / p, x);
    }
    static float gelu(float x) { return 0.5f * x * (1.0f + erf_approx(x * 0.70710678118654752f)); }

    int64_t n_layer_;
    int max_lookahead_;
    cpu::DotF32Fn dot_;
    cpu::DotF32TileFn dot_tile_;
    int64_t window_ = 0, d_model_ = 0, n_head_ = 0, d_ff_ = 0;
    std::vector<float> expert_emb_, layer_emb_, prev_emb_, prev_none_;
    std::vector<TrajectoryBlock> blocks_;
    std::vector<float> ln_f_w_, ln_f_b_;
    std::vector<std::vector<float>> head_w_, head_b_;  // [d-1]: [n_layer, E, D], [n_layer, E]

    // Scratch for up to W+1 positions, sized at load: residual stream, normalised rows / products,
    // q|k|v rows, attention output, attention logits of one head, MLP hidden, final y.
    std::vector<float> x_, h_, qkv_, att_, logits_, ff_, y_;
    std::vector<float> ones_;  // [max(D, F)] of 1: sums via the dispatched dot product
    std::vector<int32_t> key_, cached_key_;
    size_t cached_key_len_ = 0;  // 0: nothing cached (a real key has length >= 2)
};

}  // namespace

std::unique_ptr<Predictor> load_trajectory_predictor(const std::string& file, const Model& model,
                                                     int lookahead) {
    SidecarReader reader(file, "trajectory", model, lookahead);
    return std::make_unique<TrajectoryPredictor>(reader);
}

}  // namespace sharpi
