#include "ops/activation.cuh"
#include "ops/common.cuh"

namespace sharpi::cuda {
namespace {

__global__ void silu_mul_kernel(const float* gate, const float* up, int64_t n, float* y) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) y[i] = silu_mul(gate[i], up[i]);
}

}  // namespace

void launch_silu_mul(const float* gate, const float* up, int64_t n, float* y, cudaStream_t stream) {
    if (n <= 0) return;
    silu_mul_kernel<<<div_up(n, 256), 256, 0, stream>>>(gate, up, n, y);
    SHARPI_CUDA_CHECK_LAUNCH("silu_mul");
}

}  // namespace sharpi::cuda
