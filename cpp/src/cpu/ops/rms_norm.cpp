#include "cpu/ops/rms_norm.h"

#include <cmath>

namespace sharpi::cpu {

void rms_norm(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t n_rows, int64_t width,
              const float* weight, float eps) {
    for (int64_t r = 0; r < n_rows; ++r) {
        const float* xr = x + r * ldx;
        float* yr = y + r * ldy;
        double sum = 0.0;
        for (int64_t i = 0; i < width; ++i) sum += static_cast<double>(xr[i]) * xr[i];
        const float scale = static_cast<float>(1.0 / std::sqrt(sum / static_cast<double>(width) + eps));
        if (weight) {
            for (int64_t i = 0; i < width; ++i) yr[i] = xr[i] * scale * weight[i];
        } else {
            for (int64_t i = 0; i < width; ++i) yr[i] = xr[i] * scale;
        }
    }
}

}  // namespace sharpi::cpu
