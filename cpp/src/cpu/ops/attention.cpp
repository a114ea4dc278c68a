#include "cpu/ops/attention.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "cpu/ops/attention_kernels.h"
#include "sharpi/errors.h"

namespace sharpi::cpu {

namespace {

const detail::AttentionVecKernels& vec_kernels(Isa isa) {
    if (static_cast<int>(isa) > static_cast<int>(detect_isa())) {
        throw InvalidArgument(std::string("[attention] ISA ") + isa_name(isa) +
                              " requested, but this CPU runs at most " + isa_name(detect_isa()));
    }
    switch (isa) {
        case Isa::avx512:
            return detail::attention_vec_avx512();
        case Isa::avx2:
            return detail::attention_vec_avx2();
        case Isa::scalar:
            break;
    }
    return detail::attention_vec_scalar();
}

// The running softmax state of one (token, head): M, L and O[head_dim] (header comment).
struct Partial {
    float m = -INFINITY;
    float l = 0.0f;
    float* o = nullptr;
};

// Everything one (token, head) needs: its query, and its KV head's first row in each cache.
struct HeadKernels {
    DotRowFn dot_k;
    DequantRowFn dequant_v;
    const detail::AttentionVecKernels* vec;
    bool v_is_f32;
};

// Partial softmax of positions [j0, j1) (at most kAttentionBlock) into part (o: head_dim floats,
// overwritten). v_tmp: head_dim floats of scratch.
void attend_block(const HeadKernels& kern, const float* qh, const KvRows& k, const KvRows& v, size_t k_off,
                  size_t v_off, int64_t j0, int64_t j1, const AttentionShape& s, float* v_tmp,
                  Partial& part) {
    float scores[kAttentionBlock];
    float m = -INFINITY;
    for (int64_t j = j0; j < j1; ++j) {
        const float sc =
            kern.dot_k(k.data + static_cast<size_t>(j) * k.row_bytes + k_off, qh, s.head_dim) * s.scale;
        scores[j - j0] = sc;
        m = std::max(m, sc);
    }
    std::fill(part.o, part.o + s.head_dim, 0.0f);
    float l = 0.0f;
    for (int64_t j = j0; j < j1; ++j) {
        const float p = std::exp(scores[j - j0] - m);
        l += p;
        const uint8_t* vrow = v.data + static_cast<size_t>(j) * v.row_bytes + v_off;
        const float* vf = reinterpret_cast<const float*>(vrow);
        if (!kern.v_is_f32) {
            kern.dequant_v(vrow, v_tmp, s.head_dim);
            vf = v_tmp;
        }
        kern.vec->axpy(p, vf, part.o, s.head_dim);
    }
    part.m = m;
    part.l = l;
}

void merge(const HeadKernels& kern, Partial& acc, const Partial& part, int64_t head_dim) {
    const float m = std::max(acc.m, part.m);
    const float a = std::exp(acc.m - m), b = std::exp(part.m - m);
    acc.l = acc.l * a + part.l * b;
    kern.vec->scale(a, acc.o, head_dim);
    kern.vec->axpy(b, part.o, acc.o, head_dim);
    acc.m = m;
}

void finish(const HeadKernels& kern, const Partial& acc, float* out, int64_t head_dim) {
    std::copy(acc.o, acc.o + head_dim, out);
    kern.vec->scale(1.0f / acc.l, out, head_dim);
}

// The first cache position token t (at position pos0 + t) attends to.
int64_t first_kv(const AttentionShape& s, int64_t pos0, int64_t t) {
    return s.window > 0 ? std::max<int64_t>(0, pos0 + t + 1 - s.window) : 0;
}

// The running state before any block: the sink's logit counts once in L (exp(sink - M) at M = sink).
Partial initial_state(const AttentionShape& s, int64_t h, float* o, int64_t head_dim) {
    std::fill(o, o + head_dim, 0.0f);
    return s.sinks ? Partial{s.sinks[h], 1.0f, o} : Partial{-INFINITY, 0.0f, o};
}

int64_t n_blocks(int64_t n_kv) {
    return (n_kv + kAttentionBlock - 1) / kAttentionBlock;
}

bool split_blocks(int64_t n_pairs, int64_t max_blocks, int64_t head_dim, int n_threads) {
    return max_blocks > 1 && n_pairs < 4 * static_cast<int64_t>(n_threads) &&
           n_pairs * max_blocks * (head_dim + 2) <= kAttentionSplitMaxFloats;
}

}  // namespace

void attention(ThreadPool& pool, const float* q, int64_t ldq, const KvRows& k, const KvRows& v,
               int64_t n_tokens, int64_t pos0, const AttentionShape& s, float* out, int64_t ldo, Isa isa) {
    const int64_t group = s.n_head / s.n_head_kv;
    const HeadKernels kern{row_kernels(k.type, isa).dot_row, row_kernels(v.type, isa).dequant_row,
                           &vec_kernels(isa), v.type == GgmlType::F32};
    const size_t k_head_bytes = ggml_row_size(k.type, s.head_dim);
    const size_t v_head_bytes = ggml_row_size(v.type, s.head_dim);
    const int64_t n_pairs = n_tokens * s.n_head;
    const int64_t max_blocks = n_blocks(pos0 + n_tokens);
    const int64_t hd = s.head_dim;

    if (!split_blocks(n_pairs, max_blocks, hd, pool.n_threads())) {
        pool.parallel_for(n_pairs, [&](int64_t begin, int64_t end, int) {
            std::vector<float> buf(static_cast<size_t>(3 * hd));
            for (int64_t item = begin; item < end; ++item) {
                const int64_t t = item / s.n_head, h = item % s.n_head, kvh = h / group;
                const int64_t n_kv = pos0 + t + 1, j_first = first_kv(s, pos0, t);
                const float* qh = q + t * ldq + h * hd;
                Partial acc = initial_state(s, h, buf.data(), hd);
                Partial part{-INFINITY, 0.0f, buf.data() + hd};
                for (int64_t j0 = j_first / kAttentionBlock * kAttentionBlock; j0 < n_kv;
                     j0 += kAttentionBlock) {
                    attend_block(kern, qh, k, v, static_cast<size_t>(kvh) * k_head_bytes,
                                 static_cast<size_t>(kvh) * v_head_bytes, std::max(j0, j_first),
                                 std::min(j0 + kAttentionBlock, n_kv), s, buf.data() + 2 * hd, part);
                    merge(kern, acc, part, hd);
                }
                finish(kern, acc, out + t * ldo + h * hd, hd);
            }
        });
        return;
    }

    // Split: partial (m, l, o) of every (pair, block) first, then each pair merges its blocks in order.
    const int64_t stride = hd + 2;
    std::vector<float> partials(static_cast<size_t>(n_pairs * max_blocks * stride));
    pool.parallel_for(n_pairs * max_blocks, [&](int64_t begin, int64_t end, int) {
        std::vector<float> v_tmp(static_cast<size_t>(hd));
        for (int64_t item = begin; item < end; ++item) {
            const int64_t pair = item / max_blocks, blk = item % max_blocks;
            const int64_t t = pair / s.n_head, h = pair % s.n_head, kvh = h / group;
            const int64_t n_kv = pos0 + t + 1, j0 = blk * kAttentionBlock, j_first = first_kv(s, pos0, t);
            if (j0 >= n_kv || j0 + kAttentionBlock <= j_first) continue;
            float* slot = partials.data() + item * stride;
            Partial part{-INFINITY, 0.0f, slot + 2};
            attend_block(kern, q + t * ldq + h * hd, k, v, static_cast<size_t>(kvh) * k_head_bytes,
                         static_cast<size_t>(kvh) * v_head_bytes, std::max(j0, j_first),
                         std::min(j0 + kAttentionBlock, n_kv), s, v_tmp.data(), part);
            slot[0] = part.m;
            slot[1] = part.l;
        }
    });
    pool.parallel_for(n_pairs, [&](int64_t begin, int64_t end, int) {
        std::vector<float> o(static_cast<size_t>(hd));
        for (int64_t pair = begin; pair < end; ++pair) {
            const int64_t t = pair / s.n_head, h = pair % s.n_head;
            const int64_t n_kv = pos0 + t + 1;
            Partial acc = initial_state(s, h, o.data(), hd);
            for (int64_t blk = first_kv(s, pos0, t) / kAttentionBlock; blk < n_blocks(n_kv); ++blk) {
                float* slot = partials.data() + (pair * max_blocks + blk) * stride;
                merge(kern, acc, Partial{slot[0], slot[1], slot + 2}, hd);
            }
            finish(kern, acc, out + t * ldo + h * hd, hd);
        }
    });
}

}  // namespace sharpi::cpu
