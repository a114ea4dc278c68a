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

void route_topk(const float* logits, int64_t n_tokens, int64_t n_expert, int64_t k,
                const RouterParams& params, float* probs, int32_t* ids, float* weights) {
    std::vector<float> p(static_cast<size_t>(n_expert)), sel(static_cast<size_t>(n_expert));
    std::vector<int32_t> order(static_cast<size_t>(n_expert));
    const int64_t n_group = std::max<int64_t>(params.n_group, 1);
    const bool grouped = n_group > 1 && params.n_group_used < n_group;
    const int64_t group_size = n_expert / n_group;
    std::vector<float> group_score(static_cast<size_t>(n_group));
    std::vector<int32_t> group_order(static_cast<size_t>(n_group));
    std::vector<char> allowed(static_cast<size_t>(n_expert), 1);
    auto by_score = [](const std::vector<float>& s) {
        return [&s](int32_t a, int32_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); };
    };
    for (int64_t t = 0; t < n_tokens; ++t) {
        gate_scores(logits + t * n_expert, n_expert, params.gating, p.data());
        if (probs) std::copy(p.begin(), p.end(), probs + t * n_expert);
        for (int64_t e = 0; e < n_expert; ++e) {
            sel[e] = params.selection_bias ? p[e] + params.selection_bias[e] : p[e];
        }

        int64_t n_candidates = n_expert;
        for (int64_t e = 0; e < n_expert; ++e) order[e] = static_cast<int32_t>(e);
        if (grouped) {
            for (int64_t g = 0; g < n_group; ++g) {
                const float* s = sel.data() + g * group_size;
                float best = s[0], second = -INFINITY;
                for (int64_t i = 1; i < group_size; ++i) {
                    if (s[i] > best) {
                        second = best;
                        best = s[i];
                    } else if (s[i] > second) {
                        second = s[i];
                    }
                }
                group_score[g] = params.gating == Gating::sigmoid && group_size > 1 ? best + second : best;
                group_order[g] = static_cast<int32_t>(g);
            }
            std::partial_sort(group_order.begin(), group_order.begin() + params.n_group_used,
                              group_order.end(), by_score(group_score));
            std::fill(allowed.begin(), allowed.end(), 0);
            for (int64_t j = 0; j < params.n_group_used; ++j) {
                std::fill(allowed.begin() + group_order[j] * group_size,
                          allowed.begin() + (group_order[j] + 1) * group_size, 1);
            }
            n_candidates = 0;
            for (int64_t e = 0; e < n_expert; ++e) {
                if (allowed[e]) order[n_candidates++] = static_cast<int32_t>(e);
            }
        }
        std::partial_sort(order.begin(), order.begin() + k, order.begin() + n_candidates, by_score(sel));
        std::copy(order.begin(), order.begin() + k, ids + t * k);
        topk_weights(p.data(), ids + t * k, k, params, weights + t * k);
    }
}

}  // namespace sharpi::cpu
