// MoE router on the device, the arithmetic of cpu/ops/router.h without expert groups: gating scores
// (softmax, sigmoid or sqrt(softplus)) of each token's expert logits, the experts ranked by those
// scores (or by the raw logits, llama4) plus an optional per-expert selection bias, top-k (higher
// first, ties to the lower expert id), and the k weights: the chosen experts' gating scores,
// renormalised to sum 1 where the arch does (slot order, as the CPU sums them), then scaled.
// Group-limited routing (DeepSeek-V3's n_group) is not on the device (op_support.cpp).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/op_types.h"

namespace sharpi::cuda {

struct DeviceRouterSpec {
    Gating gating = Gating::softmax;
    bool normalize = false;
    float scale = 1.0f;
    const float* selection_bias = nullptr;  // [n_expert] on the device; nullptr: none
    bool rank_logits = false;
};

// logits: [n_tokens, n_expert] -> ids, weights: [n_tokens, k] (slots in rank order); probs (null:
// not written): the gating scores [n_tokens, n_expert] (the CUDA backend's route_topk output, which
// dumps and route-trace replay read).
void launch_router_topk(const float* logits, int64_t n_tokens, int64_t n_expert, int64_t k,
                        const DeviceRouterSpec& spec, int32_t* ids, float* weights, cudaStream_t stream,
                        float* probs = nullptr);

}  // namespace sharpi::cuda
