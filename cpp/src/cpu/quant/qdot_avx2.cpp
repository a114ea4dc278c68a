// Fast-mode kernels (qdot.h) with AVX2: vpmaddubsw + vpmaddwd. Compiled with the AVX2 flags;
// qdot.cpp calls into this file only when CPUID reports AVX2, FMA and F16C. The code is
// qdot_simd.h; this file supplies its two integer primitives.
#include <immintrin.h>

#include <type_traits>
#include <utility>

#include "cpu/quant/iq_unpack.h"
#include "cpu/quant/qdot_impl.h"

namespace sharpi::cpu::detail {
namespace {

inline __m256i acc_scaled_pairs(__m256i acc, __m256i u, __m256i x, __m256i s16) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), s16));
}

inline __m256i dot_quads(__m256i u, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
}

#include "cpu/quant/qdot_simd.h"

SHARPI_QDOT_TABLE(kAvx2QuantKernels)

}  // namespace

const QuantIsaKernels& avx2_quant_kernels() {
    return kAvx2QuantKernels;
}

}  // namespace sharpi::cpu::detail
