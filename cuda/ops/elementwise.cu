// One thread per element.
#include "ops/common.cuh"
#include "ops/elementwise.cuh"

namespace sharpi::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void add_kernel(const float* a, const float* b, int64_t n, float* y) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a[i] + b[i];
}

__global__ void add_bias_kernel(float* y, const float* __restrict__ bias, int64_t total, int64_t n) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < total) y[i] += bias[i % n];
}

__global__ void sigmoid_scale_kernel(float* y, const float* __restrict__ gate, int64_t total, int64_t n) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < total) y[i] *= 1.0f / (1.0f + expf(-gate[i / n]));
}

__global__ void scale_rows_kernel(float* y, const float* __restrict__ scales, int64_t total, int64_t n) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < total) y[i] *= scales[i / n];
}

}  // namespace

void launch_add(const float* a, const float* b, int64_t n, float* y, cudaStream_t stream) {
    if (n <= 0) return;
    add_kernel<<<div_up(n, kThreads), kThreads, 0, stream>>>(a, b, n, y);
    SHARPI_CUDA_CHECK_LAUNCH("add");
}

void launch_add_bias(float* y, const float* bias, int64_t n_tokens, int64_t n, cudaStream_t stream) {
    const int64_t total = n_tokens * n;
    if (total <= 0) return;
    add_bias_kernel<<<div_up(total, kThreads), kThreads, 0, stream>>>(y, bias, total, n);
    SHARPI_CUDA_CHECK_LAUNCH("add_bias");
}

void launch_scale_rows(float* y, const float* scales, int64_t n_tokens, int64_t n, cudaStream_t stream) {
    const int64_t total = n_tokens * n;
    if (total <= 0) return;
    scale_rows_kernel<<<div_up(total, kThreads), kThreads, 0, stream>>>(y, scales, total, n);
    SHARPI_CUDA_CHECK_LAUNCH("scale_rows");
}

void launch_sigmoid_scale(float* y, const float* gate, int64_t n_tokens, int64_t n, cudaStream_t stream) {
    const int64_t total = n_tokens * n;
    if (total <= 0) return;
    sigmoid_scale_kernel<<<div_up(total, kThreads), kThreads, 0, stream>>>(y, gate, total, n);
    SHARPI_CUDA_CHECK_LAUNCH("sigmoid_scale");
}

}  // namespace sharpi::cuda
