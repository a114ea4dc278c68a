// read_sweep on 256-bit loads (read_sweep.h). Eight accumulators: one 256-byte step per iteration.
#include <immintrin.h>

#include "cpu/ops/read_sweep.h"

namespace sharpi::cpu::detail {

uint64_t read_sweep_avx2(const void* data, size_t bytes) {
    const __m256i* p = static_cast<const __m256i*>(data);
    __m256i a[8];
    for (__m256i& v : a) v = _mm256_setzero_si256();
    for (size_t i = 0; i < bytes / 32; i += 8) {
        for (int k = 0; k < 8; ++k) a[k] = _mm256_xor_si256(a[k], _mm256_load_si256(p + i + k));
    }
    __m256i x = a[0];
    for (int k = 1; k < 8; ++k) x = _mm256_xor_si256(x, a[k]);
    const __m128i h = _mm_xor_si128(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    return static_cast<uint64_t>(_mm_cvtsi128_si64(h) ^ _mm_extract_epi64(h, 1));
}

}  // namespace sharpi::cpu::detail
