#include "cpu/ops/activation.h"

#include <algorithm>
#include <cmath>

namespace sharpi::cpu {

void swiglu(const float* gate, const float* up, float* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void swiglu_clamped(const float* gate, const float* up, float* out, int64_t n, float limit) {
    for (int64_t i = 0; i < n; ++i) {
        const float g = std::min(gate[i], limit);
        const float u = std::min(std::max(up[i], -limit), limit);
        out[i] = g / (1.0f + std::exp(-g)) * u;
    }
}

void swiglu_oai(const float* gate, const float* up, float* out, int64_t n, float alpha, float limit) {
    for (int64_t i = 0; i < n; ++i) {
        const float g = std::min(gate[i], limit);
        const float u = std::min(std::max(up[i], -limit), limit);
        out[i] = g / (1.0f + std::exp(alpha * -g)) * (u + 1.0f);
    }
}

void relu_sqr(const float* x, float* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        const float r = x[i] > 0.0f ? x[i] : 0.0f;
        out[i] = r * r;
    }
}

}  // namespace sharpi::cpu
