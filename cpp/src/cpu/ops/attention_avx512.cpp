// AVX-512 attention vector kernels (attention_kernels.h): 16 lanes, masked tail.
#include <immintrin.h>

#include "cpu/ops/attention_kernels.h"

namespace sharpi::cpu::detail {
namespace {

void axpy_avx512(float a, const float* x, float* y, int64_t n) {
    const __m512 va = _mm512_set1_ps(a);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    }
    if (i < n) {
        const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(
            y + i, m, _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i)));
    }
}

void scale_avx512(float a, float* y, int64_t n) {
    const __m512 va = _mm512_set1_ps(a);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_mul_ps(va, _mm512_loadu_ps(y + i)));
    if (i < n) {
        const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(va, _mm512_maskz_loadu_ps(m, y + i)));
    }
}

constexpr AttentionVecKernels kAvx512{&axpy_avx512, &scale_avx512};

}  // namespace

const AttentionVecKernels& attention_vec_avx512() {
    return kAvx512;
}

}  // namespace sharpi::cpu::detail
