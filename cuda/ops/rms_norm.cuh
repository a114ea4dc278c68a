// RMSNorm: y[t] = x[t] * (1 / sqrt(mean(x[t]^2) + eps)) * weight, per token row of n elements.
// As cpu/ops/rms_norm: the mean of squares is accumulated in f32 per thread and combined in a block
// reduction (the CPU uses a double sum; the difference is f32 rounding).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace sharpi::cuda {

// x, y: [n_tokens, n] (y may equal x); weight: [n].
void launch_rms_norm(const float* x, const float* weight, int64_t n_tokens, int64_t n, float eps, float* y,
                     cudaStream_t stream);

}  // namespace sharpi::cuda
