// One thread block per token row.
#include "ops/common.cuh"
#include "ops/rms_norm.cuh"

namespace sharpi::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void rms_norm_kernel(const float* x, const float* __restrict__ weight, int64_t n, float eps,
                                float* y) {
    const float* xr = x + static_cast<int64_t>(blockIdx.x) * n;
    float* yr = y + static_cast<int64_t>(blockIdx.x) * n;
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss);
    const float scale = rsqrtf(ss / static_cast<float>(n) + eps);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] * scale * weight[i];
}

}  // namespace

void launch_rms_norm(const float* x, const float* weight, int64_t n_tokens, int64_t n, float eps, float* y,
                     cudaStream_t stream) {
    if (n_tokens <= 0) return;
    rms_norm_kernel<<<static_cast<unsigned int>(n_tokens), kThreads, 0, stream>>>(x, weight, n, eps, y);
    SHARPI_CUDA_CHECK_LAUNCH("rms_norm");
}

}  // namespace sharpi::cuda
