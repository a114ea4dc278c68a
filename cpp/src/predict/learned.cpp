// learned: a per-source-layer MLP over the (optionally PCA-compressed) hidden state
// (docs/predictors.md, "learned"). For source layer L = 0 .. n_layer-2:
//
//     x = hidden / sqrt(mean(hidden^2) + 1e-6)
//     z = pca @ (x - pca_mean)            (z = x when R = 0)
//     a = max(w1 @ z + b1, 0)
//     s = w2 @ a + b2                      rows [(d-1)E, dE) score layer L+d
//
// Owns copies of every layer's weights and the scratch vectors (allocated at load; scores() never
// allocates). State between calls: the hidden activation `a` of the last (layer, hidden) seen, so
// the d = 1..lookahead calls of one observe() run the expensive first layer once. The cache is
// keyed on the layer and the hidden vector's bytes, never on its address: the engine reuses one
// buffer for every token.
//
// Matrix-vector products go through cpu::dot_f32_tile (chosen by CPUID at load), so this file
// needs no ISA flags.
#include <cmath>
#include <cstring>
#include <memory>
#include <string>

#include "cpu/quant/kernels.h"
#include "predict/predictor.h"
#include "predict/sidecar.h"
#include "sharpi/errors.h"

namespace sharpi {

namespace {

struct LearnedLayer {
    std::vector<float> pca_mean;  // [n_embd] (R > 0 only)
    std::vector<float> pca;       // [R, n_embd] (R > 0 only)
    std::vector<float> w1, b1;    // [H, R or n_embd], [H]
    std::vector<float> w2, b2;    // [max_lookahead * E, H], [max_lookahead * E]
};

class LearnedPredictor final : public ScoringPredictor {
  public:
    explicit LearnedPredictor(const SidecarReader& file)
        : ScoringPredictor(file.header().n_expert, file.header().top_k),
          n_layer_(file.header().n_layer),
          max_lookahead_(file.header().max_lookahead),
          dot_(cpu::dot_f32_kernel(cpu::active_isa())),
          dot_tile_(cpu::dot_f32_tile_kernel(cpu::active_isa())) {
        n_embd_ = file.uint_key("n_embd", 1, 1 << 20);
        hidden_ = file.uint_key("learned.hidden", 1, 1 << 20);
        rank_ = file.uint_key("learned.rank", 0, 1 << 20);
        const int64_t E = n_expert_;
        const int64_t in_width = rank_ > 0 ? rank_ : n_embd_;
        const int64_t n_out = max_lookahead_ * E;
        layers_.resize(static_cast<size_t>(n_layer_ > 1 ? n_layer_ - 1 : 0));
        for (int64_t il = 0; il + 1 < n_layer_; ++il) {
            LearnedLayer& l = layers_[static_cast<size_t>(il)];
            const std::string p = "learned." + std::to_string(il) + ".";
            if (rank_ > 0) {
                l.pca_mean = file.tensor(p + "pca_mean", {n_embd_});
                l.pca = file.tensor(p + "pca", {rank_, n_embd_});
            }
            l.w1 = file.tensor(p + "w1", {hidden_, in_width});
            l.b1 = file.tensor(p + "b1", {hidden_});
            l.w2 = file.tensor(p + "w2", {n_out, hidden_});
            l.b2 = file.tensor(p + "b2", {n_out});
        }
        x_.resize(static_cast<size_t>(n_embd_));
        z_.resize(static_cast<size_t>(in_width));
        a_.resize(static_cast<size_t>(hidden_));
        cached_hidden_.resize(static_cast<size_t>(n_embd_));
    }

    const char* name() const override { return "learned"; }

    bool predicts(const PredictorInput& in, int d) const override {
        return d >= 1 && d <= max_lookahead_ && in.layer >= 0 && in.layer + d < n_layer_;
    }

    void scores(const PredictorInput& in, int d, float* out) override {
        const LearnedLayer& l = layers_[static_cast<size_t>(in.layer)];
        const size_t hidden_bytes = static_cast<size_t>(n_embd_) * sizeof(float);
        if (cached_layer_ != in.layer || std::memcmp(cached_hidden_.data(), in.hidden, hidden_bytes) != 0) {
            hidden_activation(l, in.hidden);
            std::memcpy(cached_hidden_.data(), in.hidden, hidden_bytes);
            cached_layer_ = in.layer;
        }
        const int64_t E = n_expert_;
        const int64_t row0 = static_cast<int64_t>(d - 1) * E;
        dot_tile_(l.w2.data() + row0 * hidden_, hidden_, E, a_.data(), hidden_, 1, hidden_, out, E);
        for (int64_t e = 0; e < E; ++e) out[e] += l.b2[static_cast<size_t>(row0 + e)];
    }

  private:
    // a_ = max(w1 @ z + b1, 0) for `hidden`, the first two lines of the spec included.
    void hidden_activation(const LearnedLayer& l, const float* hidden) {
        const float mean_square = dot_(hidden, hidden, n_embd_) / static_cast<float>(n_embd_);
        const float inv_rms = 1.0f / std::sqrt(mean_square + 1e-6f);
        const float* z = x_.data();
        if (rank_ > 0) {
            for (int64_t i = 0; i < n_embd_; ++i) x_[i] = hidden[i] * inv_rms - l.pca_mean[i];
            dot_tile_(l.pca.data(), n_embd_, rank_, x_.data(), n_embd_, 1, n_embd_, z_.data(), rank_);
            z = z_.data();
        } else {
            for (int64_t i = 0; i < n_embd_; ++i) x_[i] = hidden[i] * inv_rms;
        }
        const int64_t in_width = rank_ > 0 ? rank_ : n_embd_;
        dot_tile_(l.w1.data(), in_width, hidden_, z, in_width, 1, in_width, a_.data(), hidden_);
        for (int64_t h = 0; h < hidden_; ++h) {
            const float v = a_[h] + l.b1[h];
            a_[h] = v > 0.0f ? v : 0.0f;
        }
    }

    int64_t n_layer_;
    int max_lookahead_;
    cpu::DotF32Fn dot_;
    cpu::DotF32TileFn dot_tile_;
    int64_t n_embd_ = 0, hidden_ = 0, rank_ = 0;
    std::vector<LearnedLayer> layers_;  // source layers 0 .. n_layer-2
    // Scratch, sized at load: x_ [n_embd], z_ [R or n_embd], a_ [H].
    std::vector<float> x_, z_, a_;
    int64_t cached_layer_ = -1;  // a_ holds the activation of (cached_layer_, cached_hidden_)
    std::vector<float> cached_hidden_;
};

}  // namespace

std::unique_ptr<Predictor> load_learned_predictor(const std::string& file, const Model& model,
                                                  int lookahead) {
    SidecarReader reader(file, "learned", model, lookahead);
    if (reader.uint_key("n_embd", 1, 1 << 20) != model.hp.n_embd) {
        throw InvalidArgument(reader.where() + "sidecar is for n_embd=" +
                              std::to_string(reader.uint_key("n_embd", 1, 1 << 20)) +
                              " but the model has n_embd=" + std::to_string(model.hp.n_embd));
    }
    return std::make_unique<LearnedPredictor>(reader);
}

}  // namespace sharpi
