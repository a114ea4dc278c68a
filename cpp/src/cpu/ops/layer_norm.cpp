#include "cpu/ops/layer_norm.h"

#include <cmath>

namespace sharpi::cpu {

void layer_norm(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t n_rows, int64_t width,
                const float* weight, const float* bias, float eps) {
    for (int64_t r = 0; r < n_rows; ++r) {
        const float* xr = x + r * ldx;
        float* yr = y + r * ldy;
        double sum = 0.0;
        for (int64_t i = 0; i < width; ++i) sum += xr[i];
        const double mean = sum / static_cast<double>(width);
        double sq = 0.0;
        for (int64_t i = 0; i < width; ++i) sq += (xr[i] - mean) * (xr[i] - mean);
        const float scale = static_cast<float>(1.0 / std::sqrt(sq / static_cast<double>(width) + eps));
        const float m = static_cast<float>(mean);
        for (int64_t i = 0; i < width; ++i) {
            float v = (xr[i] - m) * scale;
            if (weight) v *= weight[i];
            if (bias) v += bias[i];
            yr[i] = v;
        }
    }
}

}  // namespace sharpi::cpu
