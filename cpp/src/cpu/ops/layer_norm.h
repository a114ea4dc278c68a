// LayerNorm over rows with an affine weight and bias: y = (x - mean) / sqrt(var + eps) * weight +
// bias, var the biased (population) variance, as torch.nn.LayerNorm and ggml_norm compute it. Mean
// and variance accumulate in double (as rms_norm's sum of squares does), so a row's result does not
// depend on the rounding of a running f32 sum. Used by the DSA indexer's key norm (deepseek32).
#pragma once

#include <cstdint>

namespace sharpi::cpu {

// x, y: [n_rows, width] with row strides ldx, ldy (y == x is allowed). weight, bias: [width], or
// nullptr for none.
void layer_norm(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t n_rows, int64_t width,
                const float* weight, const float* bias, float eps);

}  // namespace sharpi::cpu
