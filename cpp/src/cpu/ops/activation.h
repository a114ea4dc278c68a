// Gated linear unit with SiLU: out[i] = silu(gate[i]) * up[i], silu(x) = x / (1 + exp(-x)).
#pragma once

#include <cstdint>

namespace sharpi::cpu {

void swiglu(const float* gate, const float* up, float* out, int64_t n);

inline float sigmoid(float x) {
    return 1.0f / (1.0f + __builtin_expf(-x));
}

}  // namespace sharpi::cpu
