#include "cpu/ops/activation.h"
#include "ops/activation.cuh"
#include "ops/common.cuh"

namespace sharpi::cuda {

ExpertActivation expert_activation_for(bool relu_sqr, float swiglu_clamp, float swiglu_limit) {
    ExpertActivation a;
    if (relu_sqr) {
        a.kind = ExpertActKind::relu_sqr;
    } else if (swiglu_clamp > 0.0f) {
        a.kind = ExpertActKind::swiglu_clamped;
        a.limit = swiglu_clamp;
    } else if (swiglu_limit > 0.0f) {
        a.kind = ExpertActKind::swiglu_oai;
        a.limit = swiglu_limit;
        a.alpha = cpu::kSwigluOaiAlpha;
    }
    return a;
}
namespace {

__global__ void silu_mul_kernel(const float* gate, const float* up, int64_t n, float* y) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) y[i] = silu_mul(gate[i], up[i]);
}

__global__ void expert_activation_kernel(ExpertActivation act, const float* gate, const float* up,
                                         const float* __restrict__ gate_bias,
                                         const float* __restrict__ up_bias, int64_t total, int64_t n,
                                         float* y) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= total) return;
    const int64_t c = i % n;
    const float g = act.gated() ? (gate_bias != nullptr ? gate[i] + gate_bias[c] : gate[i]) : 0.0f;
    const float u = up_bias != nullptr ? up[i] + up_bias[c] : up[i];
    y[i] = expert_activation(act, g, u);
}

}  // namespace

void launch_silu_mul(const float* gate, const float* up, int64_t n, float* y, cudaStream_t stream) {
    if (n <= 0) return;
    silu_mul_kernel<<<div_up(n, 256), 256, 0, stream>>>(gate, up, n, y);
    SHARPI_CUDA_CHECK_LAUNCH("silu_mul");
}

void launch_expert_activation(const ExpertActivation& act, const float* gate, const float* up,
                              const float* gate_bias, const float* up_bias, int64_t n_rows, int64_t n,
                              float* y, cudaStream_t stream) {
    const int64_t total = n_rows * n;
    if (total <= 0) return;
    expert_activation_kernel<<<div_up(total, 256), 256, 0, stream>>>(act, gate, up, gate_bias, up_bias, total,
                                                                     n, y);
    SHARPI_CUDA_CHECK_LAUNCH("expert activation");
}

}  // namespace sharpi::cuda
