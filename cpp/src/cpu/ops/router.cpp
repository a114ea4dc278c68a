#include "cpu/ops/router.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace sharpi::cpu {

namespace {

// Gating scores of one token's logits.
void gate_scores(const float* l, int64_t n_expert, Gating gating, float* p) {
    if (gating == Gating::sigmoid) {
        for (int64_t e = 0; e < n_expert; ++e) p[e] = 1.0f / (1.0f + std::exp(-l[e]));
        return;
    }
    if (gating == Gating::sqrt_softplus) {
        // softplus as torch computes it (linear above 20, where log1p(exp(x)) == x in f32).
        for (int64_t e = 0; e < n_expert; ++e)
            p[e] = std::sqrt(l[e] > 20.0f ? l[e] : std::log1p(std::exp(l[e])));
        return;
    }
    float max_logit = l[0];
    for (int64_t e = 1; e < n_expert; ++e) max_logit = std::max(max_logit, l[e]);
    double sum = 0.0;
    for (int64_t e = 0; e < n_expert; ++e) {
        p[e] = std::exp(l[e] - max_logit);
        sum += p[e];
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t e = 0; e < n_expert; ++e) p[e] *= inv;
}

}  // namespace

void topk_weights(const float* probs, const int32_t* ids, int64_t k, const RouterParams& params,
                  float* weights) {
    float wsum = 0.0f;
    for (int64_t j = 0; j < k; ++j) wsum += probs[ids[j]];
    for (int64_t j = 0; j < k; ++j) {
        const float w = params.normalize_topk ? probs[ids[j]] / wsum : probs[ids[j]];
        weights[j] = params.weights_scale == 1.0f ? w : w * params.weights_scale;
    }
}

void selection_scores(const float* logits, int64_t n_expert, const RouterParams& params, float* probs,
                      float* sel, GroupScratch& groups) {
    // Without probs the gating scores are computed in sel and biased in place: the same float
    // operations on the same values, so the ranking does not depend on whether probs is asked for.
    float* gate = probs ? probs : sel;
    gate_scores(logits, n_expert, params.gating, gate);
    const float* rank = params.rank_logits ? logits : gate;
    if (rank == sel) {
        if (params.selection_bias) {
            for (int64_t e = 0; e < n_expert; ++e) sel[e] += params.selection_bias[e];
        }
    } else {
        for (int64_t e = 0; e < n_expert; ++e)
            sel[e] = params.selection_bias ? rank[e] + params.selection_bias[e] : rank[e];
    }
    const int64_t n_group = std::max<int64_t>(params.n_group, 1);
    if (n_group <= 1 || params.n_group_used >= n_group) return;
    const int64_t group_size = n_expert / n_group;
    groups.score.resize(static_cast<size_t>(n_group));
    groups.order.resize(static_cast<size_t>(n_group));
    for (int64_t g = 0; g < n_group; ++g) {
        const float* s = sel + g * group_size;
        float best = s[0], second = -INFINITY;
        for (int64_t i = 1; i < group_size; ++i) {
            if (s[i] > best) {
                second = best;
                best = s[i];
            } else if (s[i] > second) {
                second = s[i];
            }
        }
        groups.score[g] = params.gating == Gating::sigmoid && group_size > 1 ? best + second : best;
        groups.order[g] = static_cast<int32_t>(g);
    }
    const std::vector<float>& gs = groups.score;
    std::partial_sort(groups.order.begin(), groups.order.begin() + params.n_group_used, groups.order.end(),
                      [&gs](int32_t a, int32_t b) { return gs[a] > gs[b] || (gs[a] == gs[b] && a < b); });
    // Experts of the groups not chosen (order[n_group_used..]) can never be selected: rank them
    // below every finite score.
    for (int64_t j = params.n_group_used; j < n_group; ++j) {
        const int64_t g = groups.order[j];
        std::fill(sel + g * group_size, sel + (g + 1) * group_size, -INFINITY);
    }
}

void route_topk(const float* logits, int64_t n_tokens, int64_t n_expert, int64_t k,
                const RouterParams& params, float* probs, int32_t* ids, float* weights) {
    std::vector<float> p(static_cast<size_t>(n_expert)), sel(static_cast<size_t>(n_expert));
    std::vector<int32_t> order(static_cast<size_t>(n_expert));
    GroupScratch groups;
    // The comparator ranks -INFINITY (experts of groups not chosen) last; k never exceeds the
    // experts of the chosen groups (hparams checks n_group_used * group size >= k), so none of them
    // is ever picked, and the choice is the one made among the chosen groups' experts alone.
    auto by_selection = [&sel](int32_t a, int32_t b) {
        return sel[a] > sel[b] || (sel[a] == sel[b] && a < b);
    };
    for (int64_t t = 0; t < n_tokens; ++t) {
        selection_scores(logits + t * n_expert, n_expert, params, p.data(), sel.data(), groups);
        if (probs) std::copy(p.begin(), p.end(), probs + t * n_expert);
        for (int64_t e = 0; e < n_expert; ++e) order[e] = static_cast<int32_t>(e);
        std::partial_sort(order.begin(), order.begin() + k, order.end(), by_selection);
        std::copy(order.begin(), order.begin() + k, ids + t * k);
        topk_weights(p.data(), ids + t * k, k, params, weights + t * k);
    }
}

}  // namespace sharpi::cpu
