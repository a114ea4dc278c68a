// Rotary position embedding, in place, on the first n_rot dimensions of every head.
//
// Two pairings, as llama.cpp names them:
//   normal: rotate (x[2i], x[2i+1])          (llama; the converter reorders q/k rows for this)
//   neox:   rotate (x[i], x[i + n_rot/2])    (qwen2, qwen2moe, qwen3, qwen3moe, olmoe)
// theta_i = pos * freq_scale * base^(-2i / n_rot); freq_scale = 1 / linear scaling factor.
#pragma once

#include <cstdint>

namespace sharpi::cpu {

enum class RopeType { normal, neox };

struct RopeParams {
    RopeType type = RopeType::normal;
    int64_t n_rot = 0;
    float freq_base = 10000.0f;
    float freq_scale = 1.0f;
};

// x: [n_tokens, n_heads * head_dim] with row stride ld; token t has position pos0 + t.
void rope(float* x, int64_t ld, int64_t n_tokens, int64_t n_heads, int64_t head_dim, int64_t pos0,
          const RopeParams& p);

}  // namespace sharpi::cpu
