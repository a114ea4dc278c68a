// Elementwise ops of the device forward pass: the residual adds, a linear layer's bias, and the
// sigmoid gate that scales qwen2moe's shared expert. Each as the CPU computes it (cpu forward.cpp,
// moe_ffn.cpp): one f32 operation per element, so the device's result equals the CPU's bit for bit
// on the same inputs (the sigmoid up to expf's last bit).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace sharpi::cuda {

// y[i] = a[i] + b[i] for i < n (y may alias a or b).
void launch_add(const float* a, const float* b, int64_t n, float* y, cudaStream_t stream);
// y: [n_tokens, n]; y[t, i] += bias[i].
void launch_add_bias(float* y, const float* bias, int64_t n_tokens, int64_t n, cudaStream_t stream);
// y: [n_tokens, n]; y[t, i] *= scales[t] with scales: [n_tokens] (on the device).
void launch_scale_rows(float* y, const float* scales, int64_t n_tokens, int64_t n, cudaStream_t stream);
// y: [n_tokens, n]; y[t, i] *= sigmoid(gate[t]) with gate: [n_tokens].
void launch_sigmoid_scale(float* y, const float* gate, int64_t n_tokens, int64_t n, cudaStream_t stream);

}  // namespace sharpi::cuda
