#include "cpu/ops/mla_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/quant/kernels.h"

namespace sharpi::cpu {

void mla_attention(ThreadPool& pool, const float* q_abs, int64_t ldq, const float* latent, int64_t ld_latent,
                   int64_t n_tokens, int64_t pos0, const MlaShape& s, float* out, int64_t ldo) {
    const int64_t key_width = s.n_lora_kv + s.n_rot;
    const DotF32Fn dot = dot_f32_kernel(active_isa());
    pool.parallel_for(n_tokens * s.n_head, [&](int64_t begin, int64_t end, int) {
        std::vector<float> p(static_cast<size_t>(pos0 + n_tokens));
        for (int64_t item = begin; item < end; ++item) {
            const int64_t t = item / s.n_head, h = item % s.n_head;
            const int64_t n_pos = pos0 + t + 1;
            const float* qh = q_abs + t * ldq + h * key_width;
            float peak = -INFINITY;
            for (int64_t j = 0; j < n_pos; ++j) {
                p[j] = dot(qh, latent + j * ld_latent, key_width) * s.scale;
                peak = std::max(peak, p[j]);
            }
            double total = 0.0;
            for (int64_t j = 0; j < n_pos; ++j) {
                p[j] = std::exp(p[j] - peak);
                total += p[j];
            }
            const float norm = static_cast<float>(1.0 / total);
            float* oh = out + t * ldo + h * s.n_lora_kv;
            std::fill(oh, oh + s.n_lora_kv, 0.0f);
            for (int64_t j = 0; j < n_pos; ++j) {
                const float w = p[j] * norm;
                const float* c = latent + j * ld_latent;  // the value is the latent's first n_lora_kv
                for (int64_t d = 0; d < s.n_lora_kv; ++d) oh[d] += w * c[d];
            }
        }
    });
}

}  // namespace sharpi::cpu
