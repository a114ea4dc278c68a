// Gated DeltaNet (Yang et al. 2024; Qwen3-Next, Qwen3.5) on the CPU: the short causal depthwise
// conv1d with its rolling state, and the gated delta rule in two forms that compute the same thing:
//
//   recurrent (decode), per value head h and token t, with S the [head_k_dim, head_v_dim] state:
//     S = exp(g_t) * S;   S += k_t (x) (beta_t * (v_t - S^T k_t));   o_t = S^T q_t
//   chunked (prefill): the same recurrence over chunks of `chunk_size` tokens, each chunk solved at
//     once with the UT transform (as transformers' torch_chunk_gated_delta_rule and FLA do). Its
//     arithmetic runs in double inside a chunk, so it agrees with the recurrent form to ~1e-6.
//
// q and k arrive L2-normalised with q already scaled by 1/sqrt(head_k_dim) (the caller owns the
// normalisation); g is the log decay (<= 0) and beta the write strength, per token and value head.
// Key heads are shared by n_v_heads / n_k_heads value heads: value head h reads key head
// h / (n_v / n_k) when the file groups value heads by key head (qwen3next, as Hugging Face does)
// and h % n_k when the converter tiled them (qwen35moe).
//
// Both forms read and update `state` in place ([n_v_heads, head_k_dim, head_v_dim] f32) and split
// work across value heads on the pool; every head's arithmetic is independent of the split.
#pragma once

#include <cstdint>

#include "backend/op_types.h"
#include "threads/thread_pool.h"

namespace sharpi::cpu {

using sharpi::GdnInputs;
using sharpi::GdnShape;

// Causal depthwise conv1d + SiLU over T tokens with a rolling state:
//   y[t][c] = silu(sum_{j<K} kernel[c][j] * xs[t + j][c]),  xs = state rows (K-1) then x rows,
// then state = the last K-1 rows of xs. x: [T, channels] (row stride ldx), y: [T, channels] (ldy),
// kernel: [channels, K], state: [K-1, channels].
// bias: [channels] added to each sum before the SiLU (Mamba-2's conv1d), or nullptr.
void conv1d_silu(float* state, const float* x, int64_t ldx, int64_t n_tokens, int64_t channels,
                 int64_t kernel_size, const float* kernel, const float* bias, float* y, int64_t ldy);

void gated_delta_rule_recurrent(ThreadPool& pool, const GdnInputs& in, int64_t n_tokens,
                                const GdnShape& shape, float* state, float* out, int64_t ldo);

// chunk_size >= 1; the last chunk may be shorter.
void gated_delta_rule_chunked(ThreadPool& pool, const GdnInputs& in, int64_t n_tokens, const GdnShape& shape,
                              int64_t chunk_size, float* state, float* out, int64_t ldo);

}  // namespace sharpi::cpu
