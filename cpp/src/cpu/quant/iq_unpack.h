// Private to cpu/quant: the IQ block layouts (quant/blocks.h) unpacked to small integers, the one
// statement of each layout that every kernel shares (exact-mode dequantize and dot on every ISA,
// and the fast mode's integer dot, whose integers are these).
//
// A 256-element IQ block unpacks to IqUnpacked: w[e] = d * sc[e / 16] * q[e], with q and sc int8
// and d an f32 that is the block's f16 scale times a power of two. |q| <= 127, |sc| <= 32, and every
// product d * sc * q is exact in f32 (at most 11 + 6 + 7 significant bits), so any evaluation
// order gives the gguf package's dequantized value bit for bit. The per-type mapping:
//   IQ2_XXS / IQ2_XS / IQ2_S: d/8, sc = 2 ls + 1, q = +-grid (8, 25, 43)
//   IQ3_XXS: d/4, sc = 2 ls + 1, q = +-grid (4..62);  IQ3_S: d, sc = 2 ls + 1, q = +-grid (1..15)
//   IQ1_S / IQ1_M: d/8, sc = 2 ls + 1, q = 8 grid +- 1 (grid in {-1, 0, 1}: the +-1/8 shift)
//   IQ4_XS: d, sc = ls - 32, q = kIq4nlValues[nibble]
// (IQ4_NL has 32-element blocks: d * kIq4nlValues[nibble], unpack_iq4_nl.)
//
// Everything here is `static` (kernels_impl.h's ODR rule): the ISA-flagged files include it too.
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "quant/blocks.h"
#include "quant/fp16.h"
#include "quant/iq_tables.h"

namespace sharpi::cpu::detail {

struct IqUnpacked {
    int8_t q[QK_K];
    int8_t sc[16];
    float d;
};

// 0x01 in byte j of the result where bit j of `signs` is set (j < 8), else 0x00: each byte of the
// spread holds one power of two or zero, and adding 0x7F sets bit 7 exactly when it is nonzero
// (no carry leaves the byte: at most 0x80 + 0x7F).
static inline uint64_t iq_sign_ones(uint8_t signs) {
    const uint64_t spread = (signs * 0x0101010101010101ull) & 0x8040201008040201ull;
    return (((spread + 0x7F7F7F7F7F7F7F7Full) | spread) >> 7) & 0x0101010101010101ull;
}

// Grid bytes g (all > 0: the IQ2 / IQ3 grids have no zero) negated where the sign bit is set, 8 (or
// 4) at a time within a 64-bit word: -g = (g ^ 0xFF) + 1 per byte, and since g > 0 that byte sum
// is at most 0xF8 + 1, so no carry crosses into the next byte.
static inline void iq_put8(int8_t* q, const int8_t* grid, uint8_t signs) {
    uint64_t g;
    memcpy(&g, grid, 8);
    const uint64_t ones = iq_sign_ones(signs);
    const uint64_t v = (g ^ (ones * 0xFF)) + ones;
    memcpy(q, &v, 8);
}
static inline void iq_put4(int8_t* q, const int8_t* grid, uint8_t signs) {
    uint32_t g;
    memcpy(&g, grid, 4);
    const uint32_t ones = static_cast<uint32_t>(iq_sign_ones(static_cast<uint8_t>(signs & 0x0F)));
    const uint32_t v = (g ^ (ones * 0xFF)) + ones;
    memcpy(q, &v, 4);
}

// 32 elements from 16 bytes: element j < 16 the low nibble of qs[j], 16 + j the high nibble.
static inline void iq4_values32(const uint8_t* qs, int8_t* q) {
    for (int j = 0; j < 16; ++j) {
        q[j] = kIq4nlValues[qs[j] & 0x0F];
        q[j + 16] = kIq4nlValues[qs[j] >> 4];
    }
}

static inline void unpack_iq4_nl(const block_iq4_nl* b, int8_t q[QK4_NL]) {
    iq4_values32(b->qs, q);
}

// IQ4_XS sub-block ib's 6-bit scale, minus 32.
static inline int iq4_xs_scale(const block_iq4_xs* b, int ib) {
    return (((b->scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0F) | ((b->scales_h >> (2 * ib)) & 3) << 4) - 32;
}

static inline void unpack_iq4_xs(const block_iq4_xs* b, IqUnpacked& u) {
    u.d = fp16_to_fp32(b->d);
    for (int ib = 0; ib < QK_K / 32; ++ib) {
        u.sc[2 * ib] = u.sc[2 * ib + 1] = static_cast<int8_t>(iq4_xs_scale(b, ib));
        iq4_values32(b->qs + 16 * ib, u.q + 32 * ib);
    }
}

static inline void unpack_iq2_xxs(const block_iq2_xxs* b, IqUnpacked& u) {
    u.d = fp16_to_fp32(b->d) * 0.125f;
    for (int ib = 0; ib < QK_K / 32; ++ib) {
        uint32_t aux[2];
        memcpy(aux, b->qs + 4 * ib, 8);
        u.sc[2 * ib] = u.sc[2 * ib + 1] = static_cast<int8_t>(2 * (aux[1] >> 28) + 1);
        for (int l = 0; l < 4; ++l) {
            const uint8_t index = static_cast<uint8_t>(aux[0] >> (8 * l));
            iq_put8(u.q + 32 * ib + 8 * l, kIq2xxsGrid[index], kIqKsigns[(aux[1] >> (7 * l)) & 127]);
        }
    }
}

static inline void unpack_iq2_xs(const block_iq2_xs* b, IqUnpacked& u) {
    u.d = fp16_to_fp32(b->d) * 0.125f;
    for (int s = 0; s < 16; ++s)
        u.sc[s] = static_cast<int8_t>(2 * ((b->scales[s / 2] >> (4 * (s % 2))) & 0x0F) + 1);
    for (int k = 0; k < QK_K / 8; ++k)
        iq_put8(u.q + 8 * k, kIq2xsGrid[b->qs[k] & 511], kIqKsigns[b->qs[k] >> 9]);
}

static inline void unpack_iq2_s(const block_iq2_s* b, IqUnpacked& u) {
    u.d = fp16_to_fp32(b->d) * 0.125f;
    for (int s = 0; s < 16; ++s)
        u.sc[s] = static_cast<int8_t>(2 * ((b->scales[s / 2] >> (4 * (s % 2))) & 0x0F) + 1);
    const uint8_t* signs = b->qs + QK_K / 8;
    for (int k = 0; k < QK_K / 8; ++k) {
        const int index = b->qs[k] | ((b->qh[k / 4] >> (2 * (k % 4))) & 3) << 8;
        iq_put8(u.q + 8 * k, kIq2sGrid[index], signs[k]);
    }
}

static inline void unpack_iq3_xxs(const block_iq3_xxs* b, IqUnpacked& u) {
    u.d = fp16_to_fp32(b->d) * 0.25f;
    const uint8_t* scales_signs = b->qs + QK_K / 4;
    for (int ib = 0; ib < QK_K / 32; ++ib) {
        uint32_t aux;
        memcpy(&aux, scales_signs + 4 * ib, 4);
        u.sc[2 * ib] = u.sc[2 * ib + 1] = static_cast<int8_t>(2 * (aux >> 28) + 1);
        for (int l = 0; l < 4; ++l) {
            const uint8_t signs = kIqKsigns[(aux >> (7 * l)) & 127];
            int8_t* q = u.q + 32 * ib + 8 * l;
            iq_put4(q, kIq3xxsGrid[b->qs[8 * ib + 2 * l]], signs);
            iq_put4(q + 4, kIq3xxsGrid[b->qs[8 * ib + 2 * l + 1]], static_cast<uint8_t>(signs >> 4));
        }
    }
}

static inline void unpack_iq3_s(const block_iq3_s* b, IqUnpacked& u) {
    u.d = fp16_to_fp32(b->d);
    for (int ib = 0; ib < QK_K / 32; ++ib) {
        u.sc[2 * ib] = u.sc[2 * ib + 1] =
            static_cast<int8_t>(2 * ((b->scales[ib / 2] >> (4 * (ib % 2))) & 0x0F) + 1);
    }
    for (int k = 0; k < QK_K / 4; ++k) {
        const int index = b->qs[k] | ((b->qh[k / 8] >> (k % 8)) & 1) << 8;
        iq_put4(u.q + 4 * k, kIq3sGrid[index], static_cast<uint8_t>(b->signs[k / 2] >> (4 * (k % 2))));
    }
}

// IQ1 entry k: q = 8 * grid + (delta negative ? -1 : +1).
static inline void iq1_put8(int8_t* q, const int8_t* grid, bool delta_negative) {
    const int shift = delta_negative ? -1 : 1;
    for (int j = 0; j < 8; ++j) q[j] = static_cast<int8_t>(8 * grid[j] + shift);
}

static inline void unpack_iq1_s(const block_iq1_s* b, IqUnpacked& u) {
    u.d = fp16_to_fp32(b->d) * 0.125f;
    for (int ib = 0; ib < QK_K / 32; ++ib) {
        const uint16_t qh = b->qh[ib];
        u.sc[2 * ib] = u.sc[2 * ib + 1] = static_cast<int8_t>(2 * ((qh >> 12) & 7) + 1);
        for (int l = 0; l < 4; ++l) {
            const int index = b->qs[4 * ib + l] | ((qh >> (3 * l)) & 7) << 8;
            iq1_put8(u.q + 32 * ib + 8 * l, kIq1sGrid[index], (qh & 0x8000) != 0);
        }
    }
}

static inline void unpack_iq1_m(const block_iq1_m* b, IqUnpacked& u) {
    uint16_t sc[4];
    memcpy(sc, b->scales, 8);
    const uint16_t d16 = static_cast<uint16_t>((sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) |
                                               ((sc[2] >> 4) & 0x0F00) | (sc[3] & 0xF000));
    u.d = fp16_to_fp32(d16) * 0.125f;
    for (int s = 0; s < 16; ++s) u.sc[s] = static_cast<int8_t>(2 * ((sc[s / 4] >> (3 * (s % 4))) & 7) + 1);
    for (int k = 0; k < QK_K / 8; ++k) {
        const int nibble = (b->qh[k / 2] >> (4 * (k % 2))) & 0x0F;
        iq1_put8(u.q + 8 * k, kIq1sGrid[b->qs[k] | (nibble & 7) << 8], (nibble & 8) != 0);
    }
}

#if defined(__AVX2__)
// iq4_values32 with one pshufb per 16 values: the 16-entry table fits a 128-bit register.
static inline __m256i iq4_values32_avx2(const uint8_t* qs) {
    const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nlValues));
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(bytes, low4));
    const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}
#endif

}  // namespace sharpi::cpu::detail
