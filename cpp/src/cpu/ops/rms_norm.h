// RMSNorm over rows: y = x / sqrt(mean(x^2) + eps) * weight. The sum of squares accumulates in
// double (as ggml does), so the result does not depend on row width rounding.
#pragma once

#include <cstdint>

namespace sharpi::cpu {

// x, y: [n_rows, width] with row strides ldx, ldy (may alias: y == x is allowed).
// weight: [width], or nullptr for no scale.
void rms_norm(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t n_rows, int64_t width,
              const float* weight, float eps);

}  // namespace sharpi::cpu
