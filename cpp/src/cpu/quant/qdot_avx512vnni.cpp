// Fast-mode kernels (qdot.h) with AVX-512 VNNI on 256-bit vectors (AVX512VL): vpdpbusd and
// vpdpwssd replace AVX2's multiply-add pairs. Compiled with the AVX-512 + VNNI flags; qdot.cpp
// calls into this file only when CPUID reports AVX-512 F/BW/VL/DQ and VNNI. The code is
// qdot_simd.h; this file supplies its two integer primitives. Same bits as the AVX2 file.
#include <immintrin.h>

#include <type_traits>
#include <utility>

#include "cpu/quant/iq_unpack.h"
#include "cpu/quant/qdot_impl.h"

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace sharpi::cpu::detail {
namespace {

inline __m256i acc_scaled_pairs(__m256i acc, __m256i u, __m256i x, __m256i s16) {
    return _mm256_dpwssd_epi32(acc, _mm256_maddubs_epi16(u, x), s16);
}

inline __m256i dot_quads(__m256i u, __m256i x) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
}

#include "cpu/quant/qdot_simd.h"

// K-quants stay on 256-bit vectors: a 512-bit version (two chunks per instruction, variable-shift
// decoders) measured 15-20% slower on the dev machine's AMD EPYC (Zen 4 splits 512-bit operations
// in two), so it was dropped.
template <typename D, int NT>
void k_dot_tokens(const void* w, const void* xq, size_t xq_stride, int64_t n, float* acc) {
    if constexpr (NT >= 2) {
        k_dot_tokens_256_wide<D, NT>(w, xq, xq_stride, n, acc);
    } else {
        k_dot_tokens_256<D, NT>(w, xq, xq_stride, n, acc);
    }
}

SHARPI_QDOT_TABLE(kAvx512VnniQuantKernels)

}  // namespace

const QuantIsaKernels& avx512vnni_quant_kernels() {
    return kAvx512VnniQuantKernels;
}

}  // namespace sharpi::cpu::detail
