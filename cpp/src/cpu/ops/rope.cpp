#include "cpu/ops/rope.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace sharpi::cpu {

void rope(float* x, int64_t ld, int64_t n_tokens, int64_t n_heads, int64_t head_dim, int64_t pos0,
          const RopeParams& p) {
    const int64_t half = p.n_rot / 2;
    std::vector<float> cos_t(static_cast<size_t>(half)), sin_t(static_cast<size_t>(half));
    for (int64_t t = 0; t < n_tokens; ++t) {
        // Angles in double: positions reach 1e5 and f32 would lose the low bits of pos * freq.
        const double pos = static_cast<double>(pos0 + t) * p.freq_scale;
        const double pos_extrap = static_cast<double>(pos0 + t);
        for (int64_t i = 0; i < half; ++i) {
            double inv_freq = std::pow(static_cast<double>(p.freq_base), -2.0 * i / p.n_rot);
            if (p.freq_factors) inv_freq /= p.freq_factors[i];
            double theta = pos * inv_freq;
            if (p.ext_factor != 0.0f) {
                const double y =
                    (static_cast<double>(i) - p.corr_low) / std::max(0.001, double{p.corr_high} - p.corr_low);
                const double mix = (1.0 - std::min(1.0, std::max(0.0, y))) * p.ext_factor;
                theta = theta * (1.0 - mix) + pos_extrap * inv_freq * mix;
            }
            cos_t[i] = static_cast<float>(std::cos(theta) * p.mscale);
            sin_t[i] = static_cast<float>(std::sin(theta) * p.mscale);
        }
        for (int64_t h = 0; h < n_heads; ++h) {
            float* v = x + t * ld + h * head_dim;
            for (int64_t i = 0; i < half; ++i) {
                const int64_t a = p.type == RopeType::neox ? i : 2 * i;
                const int64_t b = p.type == RopeType::neox ? i + half : 2 * i + 1;
                const float x0 = v[a], x1 = v[b];
                v[a] = x0 * cos_t[i] - x1 * sin_t[i];
                v[b] = x0 * sin_t[i] + x1 * cos_t[i];
            }
        }
    }
}

void rope_yarn_corr_dims(int64_t n_rot, int64_t n_ctx_orig, float freq_base, float beta_fast, float beta_slow,
                         float* low, float* high) {
    auto corr_dim = [&](float n_rotations) {
        return static_cast<double>(n_rot) *
               std::log(static_cast<double>(n_ctx_orig) / (n_rotations * 2.0 * M_PI)) /
               (2.0 * std::log(static_cast<double>(freq_base)));
    };
    *low = static_cast<float>(std::max(0.0, std::floor(corr_dim(beta_fast))));
    *high = static_cast<float>(std::min(static_cast<double>(n_rot - 1), std::ceil(corr_dim(beta_slow))));
}

}  // namespace sharpi::cpu
