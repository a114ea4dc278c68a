// Manifold-constrained hyper-connections (mHC, DeepSeek-V4; transformers' DeepseekV4HyperConnection
// and DeepseekV4HyperHead): a token's residual is n_hc streams of width d, row-major in one row
// [n_hc * d]. Before a block the streams' flat row is RMS-normalised without a weight and projected
// (hc_*_fn, by the caller) to mixes; from them:
//   pre[j]    = sigmoid(mix_pre[j] * scale[0] + base_pre[j]) + eps      collapses the streams,
//   post[k]   = 2 sigmoid(mix_post[k] * scale[1] + base_post[k])         spreads the block output,
//   comb[j,k] = softmax_k(mix_comb[j,k] * scale[2] + base_comb[j,k]) + eps, then Sinkhorn-Knopp:
//               columns normalised once, then (iters - 1) times rows and columns (each sum + eps).
// The block sees sum_j pre[j] x_j; the new streams are x'_k = post[k] out + sum_j comb[j,k] x_j.
// The head (before the final norm) keeps only pre, from mixes [n_hc] with one scale.
// Every function is per token, so a token's bits do not depend on its batch.
#pragma once

#include <cstdint>

namespace sharpi::cpu {

// y[t] = x[t] / sqrt(mean(x[t]^2) + eps), rows of `width` (stride ld for both).
void rms_norm_unweighted(const float* x, float* y, int64_t ld, int64_t n_rows, int64_t width, float eps);

// mixes: [n_tokens, (2 + n_hc) * n_hc] (pre | post | comb row-major [j][k]); base likewise; scale [3].
// pre, post: [n_tokens, n_hc]; comb: [n_tokens, n_hc * n_hc].
void hc_block_weights(const float* mixes, int64_t n_tokens, int64_t n_hc, const float* base,
                      const float* scale, float eps, int64_t sinkhorn_iters, float* pre, float* post,
                      float* comb);

// mixes, pre: [n_tokens, n_hc]; base [n_hc]; scale [1].
void hc_head_weights(const float* mixes, int64_t n_tokens, int64_t n_hc, const float* base,
                     const float* scale, float eps, float* pre);

// y[t] = sum_j pre[t, j] x[t, j*d .. (j+1)*d) (x rows [n_hc * d], y rows [d]).
void hc_collapse(const float* x, int64_t n_tokens, int64_t n_hc, int64_t d, const float* pre, float* y);

// y[t, k] = post[t, k] out[t] + sum_j comb[t, j, k] x[t, j] (x, y rows [n_hc * d]; out rows [d]).
void hc_expand(const float* x, const float* out, int64_t n_tokens, int64_t n_hc, int64_t d, const float* post,
               const float* comb, float* y);

}  // namespace sharpi::cpu
