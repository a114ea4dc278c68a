// SiLU(gate) * up, elementwise: the SwiGLU of every FFN (dense, expert, shared expert).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace sharpi::cuda {

__device__ inline float silu_mul(float gate, float up) {
    return gate / (1.0f + expf(-gate)) * up;
}

// y[i] = silu(gate[i]) * up[i] for i < n (y may alias gate or up).
void launch_silu_mul(const float* gate, const float* up, int64_t n, float* y, cudaStream_t stream);

}  // namespace sharpi::cuda
