// Causal multi-head attention (GQA) over an f32 KV cache that lives on the device.
//
// Cache layout per layer: k_cache, v_cache: [n_ctx, n_head_kv * head_dim], row p holding position
// p. The caller writes rows pos0 .. pos0 + n_tokens - 1 (the K / V projections write straight into
// them, then RoPE runs on the K rows in place) before calling; token t attends positions
// 0 .. pos0 + t, or its last `window` of them (gpt-oss's sliding layers), or those of its own
// chunk of `chunk` positions (llama4's local layers); with sinks, one learned logit per query head
// joins the softmax denominator only (gpt-oss). The limits are AttentionShape's (backend/op_types.h).
// Decode is n_tokens = 1; prefill any n_tokens (each token its own causal prefix, so prefill and
// token-by-token decoding compute the same sums in the same order).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace sharpi::cuda {

constexpr int64_t kMaxAttentionHeadDim = 256;

// Which cache positions a query sees besides its causal prefix (0: no limit), and the sinks.
struct DeviceAttentionLimits {
    int64_t window = 0;
    int64_t chunk = 0;
    const float* sinks = nullptr;  // [n_head] on the device; nullptr: none
};

// q: [n_tokens, n_head * head_dim]; out: [n_tokens, n_head * head_dim]; scale: usually
// 1 / sqrt(head_dim). Head h reads KV head h / (n_head / n_head_kv).
void launch_attention(const float* q, const float* k_cache, const float* v_cache, int64_t n_tokens,
                      int64_t pos0, int64_t n_head, int64_t n_head_kv, int64_t head_dim, float scale,
                      float* out, cudaStream_t stream, const DeviceAttentionLimits& limits = {});

}  // namespace sharpi::cuda
