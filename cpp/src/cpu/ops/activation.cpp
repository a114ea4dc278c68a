#include "cpu/ops/activation.h"

#include <cmath>

namespace sharpi::cpu {

void swiglu(const float* gate, const float* up, float* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

}  // namespace sharpi::cpu
