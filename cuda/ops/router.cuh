// MoE router on the device: softmax over each token's expert logits, top-k (higher score first,
// ties to the lower expert id, as cpu/ops/router.h), optional renormalisation of the k weights to
// sum 1 (Mixtral, Qwen3-MoE; not Qwen1.5-MoE / OLMoE). The DeepSeek variants (sigmoid, groups,
// bias) are not on the device yet.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace sharpi::cuda {

// logits: [n_tokens, n_expert] -> ids, weights: [n_tokens, k] (slots in rank order); probs (null:
// not written): the softmax [n_tokens, n_expert] the top-k chose from (the CUDA backend's route_topk
// output, which dumps and route-trace replay read).
void launch_router_softmax_topk(const float* logits, int64_t n_tokens, int64_t n_expert, int64_t k,
                                bool normalize, int32_t* ids, float* weights, cudaStream_t stream,
                                float* probs = nullptr);

}  // namespace sharpi::cuda
