// AVX2 + FMA attention vector kernels (attention_kernels.h): 8 lanes, masked tail.
#include <immintrin.h>

#include "cpu/ops/attention_kernels.h"

namespace sharpi::cpu::detail {
namespace {

inline __m256i first_lanes(int64_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

void axpy_avx2(float a, const float* x, float* y, int64_t n) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    }
    if (i < n) {
        const __m256i m = first_lanes(n - i);
        const __m256 r = _mm256_fmadd_ps(va, _mm256_maskload_ps(x + i, m), _mm256_maskload_ps(y + i, m));
        _mm256_maskstore_ps(y + i, m, r);
    }
}

void scale_avx2(float a, float* y, int64_t n) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(va, _mm256_loadu_ps(y + i)));
    if (i < n) {
        const __m256i m = first_lanes(n - i);
        _mm256_maskstore_ps(y + i, m, _mm256_mul_ps(va, _mm256_maskload_ps(y + i, m)));
    }
}

constexpr AttentionVecKernels kAvx2{&axpy_avx2, &scale_avx2};

}  // namespace

const AttentionVecKernels& attention_vec_avx2() {
    return kAvx2;
}

}  // namespace sharpi::cpu::detail
