// Rotary position embedding, in place, on the first n_rot dimensions of every head.
//
// Two pairings, as llama.cpp names them:
//   normal: rotate (x[2i], x[2i+1])          (llama; the converter reorders q/k rows for this)
//   neox:   rotate (x[i], x[i + n_rot/2])    (qwen2, qwen2moe, qwen3, qwen3moe, olmoe)
// theta_i = pos * freq_scale * base^(-2i / n_rot) / freq_factors[i]; freq_scale = 1 / linear scaling
// factor; freq_factors (llama3-style scaling, rope_freqs) divide before YaRN, as in ggml.
// YaRN (ext_factor > 0), as ggml computes it: dimension pair i mixes the interpolated angle
// (freq_scale applied) with the extrapolated one (none) by ramp(i) * ext_factor, where ramp is 1
// below corr_low, 0 above corr_high and linear between; cos and sin are multiplied by mscale.
#pragma once

#include <cstdint>

#include "backend/op_types.h"
namespace sharpi::cpu {

using sharpi::RopeParams;
using sharpi::RopeType;

// YaRN's correction range [low, high] in dimension pairs (ggml_rope_yarn_corr_dims): the pairs
// that rotate fewer than beta_fast (resp. more than beta_slow) times over n_ctx_orig positions.
void rope_yarn_corr_dims(int64_t n_rot, int64_t n_ctx_orig, float freq_base, float beta_fast, float beta_slow,
                         float* low, float* high);

// x: [n_tokens, n_heads * head_dim] with row stride ld; token t has position pos0 + t.
void rope(float* x, int64_t ld, int64_t n_tokens, int64_t n_heads, int64_t head_dim, int64_t pos0,
          const RopeParams& p);

}  // namespace sharpi::cpu
