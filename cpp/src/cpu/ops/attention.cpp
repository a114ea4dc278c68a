#include "cpu/ops/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/quant/kernels.h"

namespace sharpi::cpu {

void attention(ThreadPool& pool, const float* q, int64_t ldq, const float* k_cache, const float* v_cache,
               int64_t ld_kv, int64_t n_tokens, int64_t pos0, const AttentionShape& s, float* out,
               int64_t ldo) {
    const int64_t group = s.n_head / s.n_head_kv;
    const DotF32Fn dot = dot_f32_kernel(active_isa());
    pool.parallel_for(n_tokens * s.n_head, [&](int64_t begin, int64_t end, int) {
        std::vector<float> scores(static_cast<size_t>(pos0 + n_tokens));
        for (int64_t item = begin; item < end; ++item) {
            const int64_t t = item / s.n_head, h = item % s.n_head;
            const int64_t kvh = h / group;
            const int64_t n_kv = pos0 + t + 1;
            const float* qh = q + t * ldq + h * s.head_dim;
            float max_score = -INFINITY;
            for (int64_t j = 0; j < n_kv; ++j) {
                scores[j] = dot(qh, k_cache + j * ld_kv + kvh * s.head_dim, s.head_dim) * s.scale;
                max_score = std::max(max_score, scores[j]);
            }
            double sum = 0.0;
            for (int64_t j = 0; j < n_kv; ++j) {
                scores[j] = std::exp(scores[j] - max_score);
                sum += scores[j];
            }
            const float inv = static_cast<float>(1.0 / sum);
            float* o = out + t * ldo + h * s.head_dim;
            std::fill(o, o + s.head_dim, 0.0f);
            for (int64_t j = 0; j < n_kv; ++j) {
                const float w = scores[j] * inv;
                const float* v = v_cache + j * ld_kv + kvh * s.head_dim;
                for (int64_t d = 0; d < s.head_dim; ++d) o[d] += w * v[d];
            }
        }
    });
}

}  // namespace sharpi::cpu
