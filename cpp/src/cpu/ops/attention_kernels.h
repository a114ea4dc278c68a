// Private to cpu/ops/attention: the per-ISA vector kernels the attention loop uses beside the quant
// row kernels (cpu/quant/kernels.h supplies the K dot and the V row decode for every stored type).
// One scalar reference (attention_scalar.cpp) and AVX2 / AVX-512 versions (attention_avx2.cpp,
// attention_avx512.cpp, compiled with those flags), chosen with the quant kernels' ISA
// (cpu::active_isa(), dispatch.cpp): the SIMD tables are touched only when CPUID allows them.
//
// ODR rule as in cpu/quant/kernels_impl.h: the SIMD files use only intrinsics and their own
// file-local functions.
#pragma once

#include <cstdint>

#include "cpu/quant/kernels.h"

namespace sharpi::cpu::detail {

struct AttentionVecKernels {
    void (*axpy)(float a, const float* x, float* y, int64_t n);  // y[i] += a * x[i]
    void (*scale)(float a, float* y, int64_t n);                 // y[i] *= a
};

const AttentionVecKernels& attention_vec_scalar();
const AttentionVecKernels& attention_vec_avx2();    // only when detect_isa() >= Isa::avx2
const AttentionVecKernels& attention_vec_avx512();  // only when detect_isa() == Isa::avx512

// Fast mode's block kernels (attention.h): the arithmetic of one (query row, block) partial, the
// same whichever rows share a call, so prefill and token-by-token decoding agree bit for bit.
// head_dim is a multiple of 8 (kAttentionLanes); every scalar step below is one IEEE operation
// (fma = one rounding), and the scalar reference performs the same operations in the same order,
// so each SIMD table returns the scalar reference's bits.
//
//   score:   lane sums x_i = fma chain over d = i, i + 8, i + 16, ... of q[d] * k[d] (from 0), then
//            ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)), times scale.
//   softmax: m = max of s over [a, b); p = exp8(s - m) (below); l = the same 8-lane tree over the
//            lane sums of p, lane i summing positions a + i, a + i + 8, ... in order.
//   exp8:    x <= 0 (or -inf): below ln(FLT_MIN) the result is 0; else n = rint(x * log2e),
//            r = (x - n * ln2_hi) - n * ln2_lo (two fmas), degree-7 Taylor polynomial of e^r in
//            Horner form by fmas (|r| <= ln2 / 2: truncation under 5e-9 relative), times 2^n.
//   pv:      o[d] = fma(p_j, v_j[d], o[d]) for j in order (the exact path's axpy, per element).
constexpr int64_t kAttentionLanes = 8;

struct AttentionBlockKernels {
    // s[r * ld_s + j] = score(q_rows[r], k + j * ld_k) for r < n_rows, j in [j_begin, j_end).
    void (*scores)(const float* const* q_rows, int64_t n_rows, const float* k, int64_t ld_k, int64_t j_begin,
                   int64_t j_end, int64_t head_dim, float scale, float* s, int64_t ld_s);
    // s[a, b) -> p in place (a, b multiples of 8, some s finite, the rest -inf); returns l, sets *m.
    float (*softmax)(float* s, int64_t a, int64_t b, float* m);
    // o_rows[r][d] += p[r * ld_p + j] * v[j * ld_v + d] for j = j_begin .. j_end - 1 in order.
    void (*pv)(const float* p, int64_t ld_p, int64_t n_rows, const float* v, int64_t ld_v, int64_t j_begin,
               int64_t j_end, int64_t head_dim, float* const* o_rows);
    // scores and pv reading f16 K / V rows (the KV cache's default type) as they go: f16 -> f32 is
    // exact, so each gives the bits of its f32 twin on the rows dequantized first, without writing
    // and re-reading a decoded copy (at long contexts decoding reads more KV bytes than weights).
    void (*scores_f16)(const float* const* q_rows, int64_t n_rows, const uint16_t* k, int64_t ld_k,
                       int64_t j_begin, int64_t j_end, int64_t head_dim, float scale, float* s, int64_t ld_s);
    void (*pv_f16)(const float* p, int64_t ld_p, int64_t n_rows, const uint16_t* v, int64_t ld_v,
                   int64_t j_begin, int64_t j_end, int64_t head_dim, float* const* o_rows);
};

const AttentionBlockKernels& attention_block_scalar();
const AttentionBlockKernels& attention_block_avx2();  // also the AVX-512 table (AVX-512 CPUs have AVX2)

}  // namespace sharpi::cpu::detail
