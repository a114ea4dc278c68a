// MoE router: softmax over the expert logits of each token, top-k selection, optional
// renormalisation of the k selected probabilities to sum 1 (Mixtral, Qwen3-MoE) or not
// (Qwen1.5-MoE, OLMoE).
//
// Selection is deterministic: higher probability first; equal probabilities go to the lower expert
// id. The k slots of a token are in that rank order, and every consumer sums expert outputs in slot
// order, so a token's result does not depend on which other tokens share its batch.
#pragma once

#include <cstdint>

namespace sharpi::cpu {

// logits: [n_tokens, n_expert]; probs (out, may be nullptr): [n_tokens, n_expert];
// ids, weights (out): [n_tokens, k].
void route_topk(const float* logits, int64_t n_tokens, int64_t n_expert, int64_t k, bool normalize_topk,
                float* probs, int32_t* ids, float* weights);

}  // namespace sharpi::cpu
