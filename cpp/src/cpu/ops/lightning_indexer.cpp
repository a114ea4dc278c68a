#include "cpu/ops/lightning_indexer.h"

#include <algorithm>
#include <vector>

#include "quant/ggml_type.h"

namespace sharpi::cpu {

void lightning_indexer(ThreadPool& pool, const float* q, int64_t ldq, const float* w, int64_t ldw,
                       const KvRows& rows, int64_t n_tokens, int64_t pos0, const IndexerShape& s,
                       int32_t* positions, int32_t* count, Isa isa) {
    const DotF32Fn dot = dot_f32_kernel(isa);
    const bool in_place = rows.type == GgmlType::F32;
    const DequantRowFn dequant = row_kernels(rows.type, isa).dequant_row;
    const size_t key_byte_offset = ggml_row_size(rows.type, s.key_offset);
    pool.parallel_for(n_tokens, [&](int64_t begin, int64_t end, int) {
        std::vector<float> scores, decoded(static_cast<size_t>(s.head_dim)),
            head_weight(static_cast<size_t>(s.n_head));
        std::vector<int32_t> order;
        for (int64_t t = begin; t < end; ++t) {
            const int64_t n_pos = pos0 + t + 1;
            int32_t* out = positions + t * s.top_k;
            if (n_pos <= s.top_k) {
                for (int64_t j = 0; j < n_pos; ++j) out[j] = static_cast<int32_t>(j);
                count[t] = static_cast<int32_t>(n_pos);
                continue;
            }
            for (int64_t h = 0; h < s.n_head; ++h)
                head_weight[static_cast<size_t>(h)] = w[t * ldw + h] * s.weight_scale;
            scores.assign(static_cast<size_t>(n_pos), 0.0f);
            for (int64_t j = 0; j < n_pos; ++j) {
                const uint8_t* row = rows.data + static_cast<size_t>(j) * rows.row_bytes + key_byte_offset;
                const float* key = reinterpret_cast<const float*>(row);
                if (!in_place) {
                    dequant(row, decoded.data(), s.head_dim);
                    key = decoded.data();
                }
                float score = 0.0f;
                for (int64_t h = 0; h < s.n_head; ++h) {
                    const float qk = dot(q + t * ldq + h * s.head_dim, key, s.head_dim);
                    score += head_weight[static_cast<size_t>(h)] * std::max(qk, 0.0f);
                }
                scores[static_cast<size_t>(j)] = score;
            }
            order.resize(static_cast<size_t>(n_pos));
            for (int64_t j = 0; j < n_pos; ++j) order[static_cast<size_t>(j)] = static_cast<int32_t>(j);
            // Higher score first; equal scores: the earlier position (a strict total order, so the
            // kept set is fully determined).
            std::partial_sort(order.begin(), order.begin() + s.top_k, order.end(), [&](int32_t a, int32_t b) {
                const float sa = scores[static_cast<size_t>(a)], sb = scores[static_cast<size_t>(b)];
                return sa > sb || (sa == sb && a < b);
            });
            std::sort(order.begin(), order.begin() + s.top_k);
            std::copy(order.begin(), order.begin() + s.top_k, out);
            count[t] = static_cast<int32_t>(s.top_k);
        }
    });
}

}  // namespace sharpi::cpu
