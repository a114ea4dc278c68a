#include "cpu/ops/mla_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace sharpi::cpu {

namespace {

// Latent rows decoded to f32 at a time (a quantized cache): 64 rows of 576 floats = 144 KiB per
// thread on DeepSeek-V2 shapes, inside the "rest" the budget planner charges (memory_plan.h).
constexpr int64_t kMlaRowBlock = 64;
// Heads of one token a work item computes: each decoded block is read by this many heads, so a
// quantized row is decoded n_head / kMlaHeadsPerItem times per token instead of n_head times.
constexpr int64_t kMlaHeadsPerItem = 4;

}  // namespace

void mla_attention(ThreadPool& pool, const float* q_abs, int64_t ldq, const KvRows& latent, int64_t n_tokens,
                   int64_t pos0, const MlaShape& s, float* out, int64_t ldo, Isa isa,
                   const MlaSelection* selection) {
    const int64_t key_width = s.n_lora_kv + s.n_rot;
    const DotF32Fn dot = dot_f32_kernel(isa);
    const bool in_place = latent.type == GgmlType::F32;
    const DequantRowFn dequant = row_kernels(latent.type, isa).dequant_row;
    const int64_t n_chunks = (s.n_head + kMlaHeadsPerItem - 1) / kMlaHeadsPerItem;
    const int64_t n_pos_max = pos0 + n_tokens;
    pool.parallel_for(n_tokens * n_chunks, [&](int64_t begin, int64_t end, int) {
        std::vector<float> p(static_cast<size_t>(kMlaHeadsPerItem * n_pos_max));
        std::vector<float> decoded(in_place ? 0 : static_cast<size_t>(kMlaRowBlock * key_width));
        const float* row_ptr[kMlaRowBlock];
        float norm[kMlaHeadsPerItem];
        // The rows of attended entries [i0, i1) as f32 (row_ptr[i - i0]): in place for an f32 cache,
        // else decoded by the stored type's kernel. Entry i is position i, or the selection's i-th.
        const int32_t* list = nullptr;
        auto rows = [&](int64_t i0, int64_t i1) {
            for (int64_t i = i0; i < i1; ++i) {
                const int64_t j = list ? list[i] : i;
                const uint8_t* src = latent.data + static_cast<size_t>(j) * latent.row_bytes;
                if (in_place) {
                    row_ptr[i - i0] = reinterpret_cast<const float*>(src);
                } else {
                    float* dst = decoded.data() + (i - i0) * key_width;
                    dequant(src, dst, key_width);
                    row_ptr[i - i0] = dst;
                }
            }
        };
        for (int64_t item = begin; item < end; ++item) {
            const int64_t t = item / n_chunks, h0 = (item % n_chunks) * kMlaHeadsPerItem;
            const int64_t h1 = std::min(h0 + kMlaHeadsPerItem, s.n_head);
            list = selection ? selection->positions + t * selection->ld : nullptr;
            const int64_t n_pos = selection ? selection->count[t] : pos0 + t + 1;
            for (int64_t j0 = 0; j0 < n_pos; j0 += kMlaRowBlock) {
                const int64_t j1 = std::min(j0 + kMlaRowBlock, n_pos);
                rows(j0, j1);
                for (int64_t h = h0; h < h1; ++h) {
                    const float* qh = q_abs + t * ldq + h * key_width;
                    float* ph = p.data() + (h - h0) * n_pos_max;
                    for (int64_t j = j0; j < j1; ++j) ph[j] = dot(qh, row_ptr[j - j0], key_width) * s.scale;
                }
            }
            for (int64_t h = h0; h < h1; ++h) {
                float* ph = p.data() + (h - h0) * n_pos_max;
                float peak = -INFINITY;
                for (int64_t j = 0; j < n_pos; ++j) peak = std::max(peak, ph[j]);
                double total = 0.0;
                for (int64_t j = 0; j < n_pos; ++j) {
                    ph[j] = std::exp(ph[j] - peak);
                    total += ph[j];
                }
                norm[h - h0] = static_cast<float>(1.0 / total);
                float* oh = out + t * ldo + h * s.n_lora_kv;
                std::fill(oh, oh + s.n_lora_kv, 0.0f);
            }
            for (int64_t j0 = 0; j0 < n_pos; j0 += kMlaRowBlock) {
                const int64_t j1 = std::min(j0 + kMlaRowBlock, n_pos);
                rows(j0, j1);
                for (int64_t h = h0; h < h1; ++h) {
                    const float* ph = p.data() + (h - h0) * n_pos_max;
                    float* oh = out + t * ldo + h * s.n_lora_kv;
                    for (int64_t j = j0; j < j1; ++j) {
                        const float w = ph[j] * norm[h - h0];
                        const float* c = row_ptr[j - j0];  // the value is the latent's first n_lora_kv
                        for (int64_t d = 0; d < s.n_lora_kv; ++d) oh[d] += w * c[d];
                    }
                }
            }
        }
    });
}

}  // namespace sharpi::cpu
