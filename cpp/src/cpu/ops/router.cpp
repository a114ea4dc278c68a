#include "cpu/ops/router.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace sharpi::cpu {

void route_topk(const float* logits, int64_t n_tokens, int64_t n_expert, int64_t k, bool normalize_topk,
                float* probs, int32_t* ids, float* weights) {
    std::vector<float> p(static_cast<size_t>(n_expert));
    std::vector<int32_t> order(static_cast<size_t>(n_expert));
    for (int64_t t = 0; t < n_tokens; ++t) {
        const float* l = logits + t * n_expert;
        float max_logit = l[0];
        for (int64_t e = 1; e < n_expert; ++e) max_logit = std::max(max_logit, l[e]);
        double sum = 0.0;
        for (int64_t e = 0; e < n_expert; ++e) {
            p[e] = std::exp(l[e] - max_logit);
            sum += p[e];
        }
        const float inv = static_cast<float>(1.0 / sum);
        for (int64_t e = 0; e < n_expert; ++e) p[e] *= inv;
        if (probs) std::copy(p.begin(), p.end(), probs + t * n_expert);

        for (int64_t e = 0; e < n_expert; ++e) order[e] = static_cast<int32_t>(e);
        std::partial_sort(order.begin(), order.begin() + k, order.end(),
                          [&](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
        float wsum = 0.0f;
        for (int64_t j = 0; j < k; ++j) wsum += p[order[j]];
        for (int64_t j = 0; j < k; ++j) {
            ids[t * k + j] = order[j];
            weights[t * k + j] = normalize_topk ? p[order[j]] / wsum : p[order[j]];
        }
    }
}

}  // namespace sharpi::cpu
