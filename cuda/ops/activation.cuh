// The FFN activations, elementwise: SiLU(gate) * up (every SwiGLU: dense, expert, shared expert) and
// the expert variants of cpu/ops/activation.h: gpt-oss's clamped SwiGLU (alpha, limit, up + 1),
// DeepSeek-V4's clamped SwiGLU, Nemotron-H's ungated relu^2 (of up alone). Same float operations in
// the same order as the CPU's, so only expf may differ in its last bits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace sharpi::cuda {

__device__ inline float silu_mul(float gate, float up) {
    return gate / (1.0f + expf(-gate)) * up;
}

enum class ExpertActKind { swiglu, swiglu_clamped, swiglu_oai, relu_sqr };

struct ExpertActivation {
    ExpertActKind kind = ExpertActKind::swiglu;
    float limit = 0.0f;  // the clamp of swiglu_clamped / swiglu_oai
    float alpha = 0.0f;  // swiglu_oai's sigmoid slope (kSwigluOaiAlpha)
    __host__ __device__ bool gated() const { return kind != ExpertActKind::relu_sqr; }
};

// The variant cpu/ops/expert_ffn.cpp's expert_glu picks, in its order: relu^2, else the V4 clamp,
// else gpt-oss's limit, else SwiGLU.
ExpertActivation expert_activation_for(bool relu_sqr, float swiglu_clamp, float swiglu_limit);

__device__ inline float expert_activation(const ExpertActivation& a, float gate, float up) {
    switch (a.kind) {
        case ExpertActKind::swiglu:
            return silu_mul(gate, up);
        case ExpertActKind::swiglu_clamped: {
            const float g = fminf(gate, a.limit), u = fminf(fmaxf(up, -a.limit), a.limit);
            return g / (1.0f + expf(-g)) * u;
        }
        case ExpertActKind::swiglu_oai: {
            const float g = fminf(gate, a.limit), u = fminf(fmaxf(up, -a.limit), a.limit);
            return g / (1.0f + expf(a.alpha * -g)) * (u + 1.0f);
        }
        case ExpertActKind::relu_sqr: {
            const float r = up > 0.0f ? up : 0.0f;
            return r * r;
        }
    }
    return 0.0f;
}

// y[i] = silu(gate[i]) * up[i] for i < n (y may alias gate or up).
void launch_silu_mul(const float* gate, const float* up, int64_t n, float* y, cudaStream_t stream);

// y[r, i] = act(gate[r, i] + gate_bias[i], up[r, i] + up_bias[i]) over n_rows rows of n (a bias may
// be null: none; gate unread for relu^2; y may alias gate or up).
void launch_expert_activation(const ExpertActivation& act, const float* gate, const float* up,
                              const float* gate_bias, const float* up_bias, int64_t n_rows, int64_t n,
                              float* y, cudaStream_t stream);

}  // namespace sharpi::cuda
