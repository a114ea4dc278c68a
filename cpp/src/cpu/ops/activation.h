// Gated linear unit with SiLU: out[i] = silu(gate[i]) * up[i], silu(x) = x / (1 + exp(-x)).
#pragma once

#include <cstdint>

namespace sharpi::cpu {

void swiglu(const float* gate, const float* up, float* out, int64_t n);

// gpt-oss's clamped SwiGLU (transformers' GptOssExperts, ggml's swiglu_oai), in ggml's order:
//   g = min(gate, limit), u = clamp(up, -limit, limit), out = g / (1 + exp(-alpha g)) * (u + 1).
constexpr float kSwigluOaiAlpha = 1.702f;
// DeepSeek-V4's clamped SwiGLU (transformers' DeepseekV4Experts): silu(min(gate, limit)) * clamp(up, -limit,
// limit).
void swiglu_clamped(const float* gate, const float* up, float* out, int64_t n, float limit);

void swiglu_oai(const float* gate, const float* up, float* out, int64_t n, float alpha, float limit);

// nemotron_h_moe's squared ReLU: out[i] = max(x[i], 0)^2 (out may alias x).
void relu_sqr(const float* x, float* out, int64_t n);

inline float sigmoid(float x) {
    return 1.0f / (1.0f + __builtin_expf(-x));
}

}  // namespace sharpi::cpu
