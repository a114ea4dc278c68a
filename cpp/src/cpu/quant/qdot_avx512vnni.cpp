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

SHARPI_QDOT_TABLE(kAvx512VnniQuantKernels)

}  // namespace

const QuantIsaKernels& avx512vnni_quant_kernels() {
    return kAvx512VnniQuantKernels;
}

}  // namespace sharpi::cpu::detail
