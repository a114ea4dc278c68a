// Scalar reference of the attention vector kernels (attention_kernels.h).
#include "cpu/ops/attention_kernels.h"

namespace sharpi::cpu::detail {
namespace {

void axpy_scalar(float a, const float* x, float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

void scale_scalar(float a, float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] *= a;
}

constexpr AttentionVecKernels kScalar{&axpy_scalar, &scale_scalar};

}  // namespace

const AttentionVecKernels& attention_vec_scalar() {
    return kScalar;
}

}  // namespace sharpi::cpu::detail
