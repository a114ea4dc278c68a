// MoE router: gating scores over the expert logits of each token, top-k selection, optional
// renormalisation of the k selected weights to sum 1 (Mixtral, Qwen3-MoE) or not (Qwen1.5-MoE,
// OLMoE), and the DeepSeek variants:
//   - sigmoid scores instead of softmax (DeepSeek-V3, expert_gating_func = 2);
//   - a per-expert selection bias added to the scores for choosing only (V3 `noaux_tc`,
//     exp_probs_b); the weights stay the unbiased scores;
//   - group-limited top-k: experts form n_group equal groups, only the best n_group_used groups
//     may be chosen. A group's score is its best expert's score for softmax gating (V2
//     `group_limited_greedy`) and the sum of its two best biased scores for sigmoid (V3);
//   - the final weights multiplied by weights_scale (routed_scaling_factor).
//   - ranking by the raw logits instead of the scores (llama4, rank_logits; sigmoid weights).
//
// Selection is deterministic: higher selection score first; equal scores go to the lower expert
// id (groups likewise). The k slots of a token are in that rank order, and every consumer sums
// expert outputs in slot order, so a token's result does not depend on which other tokens share
// its batch.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/op_types.h"
namespace sharpi::cpu {

using sharpi::Gating;
using sharpi::RouterParams;

// logits: [n_tokens, n_expert]; probs (out, may be nullptr): [n_tokens, n_expert] gating scores
// (before bias); ids, weights (out): [n_tokens, k].
void route_topk(const float* logits, int64_t n_tokens, int64_t n_expert, int64_t k,
                const RouterParams& params, float* probs, int32_t* ids, float* weights);

// Per-group scores and ranks for group-limited selection. The caller owns it so that repeated calls
// (the tokens of a batch, the predictions of a session) reuse its capacity: after the first call
// with a given n_group, selection_scores allocates nothing.
struct GroupScratch {
    std::vector<float> score;
    std::vector<int32_t> order;
};

// The scores route_topk ranks one token's experts by, from its logits: sel[e] = gating score +
// selection bias, and -INFINITY for every expert outside the n_group_used best groups; probs (out,
// may be nullptr): the gating scores. route_topk picks the k best of sel (ties: lower id). Used
// alone by the next_gate predictor, which must rank a layer's experts exactly as that layer's
// router will, and needs no probs.
void selection_scores(const float* logits, int64_t n_expert, const RouterParams& params, float* probs,
                      float* sel, GroupScratch& groups);

// The weights of already chosen experts ids[0..k) from one token's gating scores, as route_topk
// computes them (renormalised if asked, then scaled).
void topk_weights(const float* probs, const int32_t* ids, int64_t k, const RouterParams& params,
                  float* weights);

}  // namespace sharpi::cpu
