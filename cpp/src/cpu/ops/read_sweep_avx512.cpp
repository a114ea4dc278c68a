// read_sweep on 512-bit loads (read_sweep.h). Four accumulators: one 256-byte step per iteration.
#include <immintrin.h>

#include "cpu/ops/read_sweep.h"

namespace sharpi::cpu::detail {

uint64_t read_sweep_avx512(const void* data, size_t bytes) {
    const __m512i* p = static_cast<const __m512i*>(data);
    __m512i a[4];
    for (__m512i& v : a) v = _mm512_setzero_si512();
    for (size_t i = 0; i < bytes / 64; i += 4) {
        for (int k = 0; k < 4; ++k) a[k] = _mm512_xor_si512(a[k], _mm512_load_si512(p + i + k));
    }
    const __m512i x = _mm512_xor_si512(_mm512_xor_si512(a[0], a[1]), _mm512_xor_si512(a[2], a[3]));
    alignas(64) uint64_t lanes[8];
    _mm512_store_si512(lanes, x);
    uint64_t r = 0;
    for (uint64_t v : lanes) r ^= v;
    return r;
}

}  // namespace sharpi::cpu::detail
