#include "cpu/ops/rope.h"

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
        for (int64_t i = 0; i < half; ++i) {
            const double theta = pos * std::pow(static_cast<double>(p.freq_base), -2.0 * i / p.n_rot);
            cos_t[i] = static_cast<float>(std::cos(theta));
            sin_t[i] = static_cast<float>(std::sin(theta));
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

}  // namespace sharpi::cpu
