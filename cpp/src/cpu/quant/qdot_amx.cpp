// Fast-mode prefill on Intel AMX-INT8 tiles (qdot.h's AmxKernels): Q4_K and Q6_K weights x q8_K
// activations, the arithmetic of qdot.h bit for bit.
//
// Per 256-element block qdot.h forms exact integer sums, isum = sum_j sc_j S_j (- 32 sum_j sc_j
// bsum_j for Q6_K's offset) and, for Q4_K, imin = sum_j mn_j bsum_j, over the sub-blocks j that
// share a scale, with S_j = sum_{i in j} u_i q_i (u the unsigned quants, q the activations) and
// bsum_j the activations' sum over j. Integer sums are exact in any order, so the tiles may form
// them. TDPBUSD multiplies unsigned bytes (A: 16 rows x 64 elements) by signed ones (B: the tokens'
// activations in the VNNI layout) into int32 (C: 16 rows x 16 tokens); to keep the scales out of
// the combining step, each is split into small digits that are folded into the rows' quants
// (u * digit still fits a byte), so a few accumulators span the whole block and isum is their
// shifted sum. The bsum terms go through vpdpwssd on int16 pairs. Then qdot.h's float steps per
// (row, token), 16 tokens to a vector, blocks in order from acc = 0: acc += (dx * d) * float(isum);
// acc -= (dx * dmin) * float(imin) (Q4_K). Multiplication commutes bit for bit, so (d * dx) in a
// lane equals the scalar (dx * d), and every (row, token) gets exactly its vec_dot.
//
// Compiled with the AMX and AVX-512 flags; qdot.cpp calls into this file only when CPUID reports
// AMX-INT8 and AVX-512 VNNI, the OS enables the tile state (XCR0) and grants it to the process
// (arch_prctl ARCH_REQ_XCOMP_PERM).
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "cpu/quant/qdot_impl.h"
#include "quant/blocks.h"
#include "quant/fp16.h"

// GCC 12's _mm512_set1_* headers trip -Wmaybe-uninitialized (as in qdot_avx512vnni.cpp).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace sharpi::cpu::detail {
namespace {

struct alignas(64) TileConfig {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Every tile used is 16 rows x 64 bytes: C (16 tokens of int32), A (64 elements of 16 rows), B
// (64 elements of 16 tokens, 4 per row).
void load_tile_config(int n_tiles) {
    TileConfig cfg;
    std::memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < n_tiles; ++t) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

// The activations of up to 16 tokens for every block, packed once and read by every row tile:
// per block, the B rows (row k holds, for each token t, the 4 bytes q_t[4k .. 4k + 3]: the B tile
// of 64 elements from e is the 16 rows from e / 4), the tokens' dx [16], and their block sums as
// int16 pairs in an int32 for vpdpwssd (low: the even sum, high: the odd one; exact, no
// saturation): the 16-element sums bsum[2j], bsum[2j + 1] (|sum| <= 16 * 127) for Q6_K's offset,
// and the 32-element sums of sub-blocks 2j, 2j + 1 (|sum| <= 32 * 127) for Q4_K's mins.
struct PackedBlock {
    int8_t b[QK_K / 4][kAmxTokens * 4];
    float dx[kAmxTokens];
    int32_t bsum16_pairs[QK_K / 32][kAmxTokens];
    int32_t bsum32_pairs[QK_K / 64][kAmxTokens];
};

int32_t int16_pair(int32_t even, int32_t odd) {
    return static_cast<int32_t>((static_cast<uint32_t>(odd) << 16) | (static_cast<uint32_t>(even) & 0xFFFFu));
}

size_t packed_bytes(int64_t n) {
    return static_cast<size_t>(n / QK_K) * sizeof(PackedBlock);
}

void q8_K_pack(const void* xq, size_t xq_stride, int n_tokens, int64_t n, void* packed) {
    PackedBlock* out = static_cast<PackedBlock*>(packed);
    for (int64_t ib = 0; ib < n / QK_K; ++ib) {
        PackedBlock& p = out[ib];
        std::memset(&p, 0, sizeof(p));  // tokens past n_tokens: zero activations
        for (int t = 0; t < n_tokens; ++t) {
            const block_q8_K& x =
                reinterpret_cast<const block_q8_K*>(static_cast<const uint8_t*>(xq) + t * xq_stride)[ib];
            for (int k = 0; k < QK_K / 4; ++k) std::memcpy(&p.b[k][4 * t], x.qs + 4 * k, 4);
            for (int j = 0; j < QK_K / 32; ++j)
                p.bsum16_pairs[j][t] = int16_pair(x.bsums[2 * j], x.bsums[2 * j + 1]);
            for (int j = 0; j < QK_K / 64; ++j) {
                p.bsum32_pairs[j][t] =
                    int16_pair(x.bsums[4 * j] + x.bsums[4 * j + 1], x.bsums[4 * j + 2] + x.bsums[4 * j + 3]);
            }
            p.dx[t] = x.d;
        }
    }
}

// y[t * ldy + r] = the accumulator of token t: its tile's row r, lane t % 16.
void store_tiles(const float* acc_tiles, int n_rows, int64_t n_tokens, float* y, int64_t ldy) {
    for (int64_t t = 0; t < n_tokens; ++t) {
        const float* tile = acc_tiles + (t / kAmxTokens) * kAmxRows * kAmxTokens;
        for (int r = 0; r < n_rows; ++r) y[t * ldy + r] = tile[r * kAmxTokens + t % kAmxTokens];
    }
}

// The accumulators of every token tile, [tile][row][token], zeroed: a thread's scratch.
float* zeroed_accumulators(int64_t n_tiles) {
    thread_local std::vector<float> acc;
    acc.assign(static_cast<size_t>(n_tiles * kAmxRows * kAmxTokens), 0.0f);
    return acc.data();
}

// Q4_K on whole blocks: each 6-bit scale splits as sc = 8 * hi + lo (hi, lo <= 7), and the rows'
// quants are stored pre-multiplied, u * hi and u * lo (<= 105: still unsigned bytes), so two
// accumulators over all 256 elements (K = 64 per TDPBUSD) give sum_j hi_j S[j] and sum_j lo_j S[j]
// and isum = 8 * C_hi + C_lo, the same integer. The mins: imin = sum_j mn_j * (bsum[2j] + bsum[2j +
// 1]) by vpdpwssd over int16 pairs (exact, no saturation). A block's rows are unpacked once for
// every token tile.
void gemm_q4_K(const void* w, size_t row_bytes, int n_rows, const void* packed, int64_t n_tokens, int64_t n,
               float* y, int64_t ldy) {
    const int64_t n_blocks = n / QK_K, n_tiles = (n_tokens + kAmxTokens - 1) / kAmxTokens;
    alignas(64) uint8_t a_hi[kAmxRows][QK_K], a_lo[kAmxRows][QK_K];
    alignas(64) int32_t c_hi[kAmxRows][kAmxTokens], c_lo[kAmxRows][kAmxTokens];
    int32_t mn_pairs[kAmxRows][QK_K / 64];
    float d[kAmxRows], dmin[kAmxRows];
    std::memset(a_hi, 0, sizeof(a_hi));  // rows past n_rows: zero quants, never read back
    std::memset(a_lo, 0, sizeof(a_lo));
    float* acc_tiles = zeroed_accumulators(n_tiles);
    load_tile_config(5);  // 0, 1: C hi / lo; 2, 3: A hi / lo; 4: B
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int64_t ib = 0; ib < n_blocks; ++ib) {
        for (int r = 0; r < n_rows; ++r) {
            const block_q4_K& b =
                reinterpret_cast<const block_q4_K*>(static_cast<const uint8_t*>(w) + r * row_bytes)[ib];
            const Q4KScaleWords words = unpack_q4_K_scale_min(b.scales);
            uint8_t sc[8], mn[8];
            for (int j = 0; j < 4; ++j) {
                sc[j] = static_cast<uint8_t>(words.sc_lo >> (8 * j));
                sc[j + 4] = static_cast<uint8_t>(words.sc_hi >> (8 * j));
                mn[j] = static_cast<uint8_t>(words.m_lo >> (8 * j));
                mn[j + 4] = static_cast<uint8_t>(words.m_hi >> (8 * j));
            }
            for (int j = 0; j < 4; ++j) {
                const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs + 32 * j));
                const __m256i u[2] = {_mm256_and_si256(q, low4),
                                      _mm256_and_si256(_mm256_srli_epi16(q, 4), low4)};
                for (int half = 0; half < 2; ++half) {
                    const int sub = 2 * j + half;  // elements 32 sub .. 32 sub + 31
                    // Bytes times a scale <= 7 in 16-bit lanes: no product reaches the high byte.
                    const __m256i hi = _mm256_mullo_epi16(u[half], _mm256_set1_epi16(sc[sub] >> 3));
                    const __m256i lo = _mm256_mullo_epi16(u[half], _mm256_set1_epi16(sc[sub] & 7));
                    _mm256_store_si256(reinterpret_cast<__m256i*>(a_hi[r] + 32 * sub), hi);
                    _mm256_store_si256(reinterpret_cast<__m256i*>(a_lo[r] + 32 * sub), lo);
                }
            }
            for (int k = 0; k < 4; ++k) mn_pairs[r][k] = mn[2 * k] | (mn[2 * k + 1] << 16);
            d[r] = fp16_to_fp32(b.d);
            dmin[r] = fp16_to_fp32(b.dmin);
        }
        for (int64_t tile = 0; tile < n_tiles; ++tile) {
            const PackedBlock& p = static_cast<const PackedBlock*>(packed)[tile * n_blocks + ib];
            float* acc = acc_tiles + tile * kAmxRows * kAmxTokens;
            _tile_zero(0);
            _tile_zero(1);
            for (int k = 0; k < QK_K / 64; ++k) {
                _tile_loadd(4, &p.b[16 * k][0], kAmxTokens * 4);
                _tile_loadd(2, a_hi[0] + 64 * k, QK_K);
                _tile_dpbusd(0, 2, 4);
                _tile_loadd(3, a_lo[0] + 64 * k, QK_K);
                _tile_dpbusd(1, 3, 4);
            }
            _tile_stored(0, c_hi, kAmxTokens * 4);
            _tile_stored(1, c_lo, kAmxTokens * 4);
            const __m512 dx = _mm512_loadu_ps(p.dx);
            for (int r = 0; r < n_rows; ++r) {
                const __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c_hi[r]), 3),
                                                      _mm512_load_si512(c_lo[r]));
                __m512i imin = _mm512_setzero_si512();
                for (int k = 0; k < QK_K / 64; ++k)
                    imin = _mm512_dpwssd_epi32(imin, _mm512_set1_epi32(mn_pairs[r][k]),
                                               _mm512_loadu_si512(p.bsum32_pairs[k]));
                // qdot.h's order: acc = acc + (dx * d) * float(isum); acc = acc - (dx * dmin) * float(imin).
                __m512 a = _mm512_loadu_ps(acc + r * kAmxTokens);
                a = _mm512_add_ps(
                    a, _mm512_mul_ps(_mm512_mul_ps(dx, _mm512_set1_ps(d[r])), _mm512_cvtepi32_ps(isum)));
                a = _mm512_sub_ps(
                    a, _mm512_mul_ps(_mm512_mul_ps(dx, _mm512_set1_ps(dmin[r])), _mm512_cvtepi32_ps(imin)));
                _mm512_storeu_ps(acc + r * kAmxTokens, a);
            }
        }
    }
    _tile_release();
    store_tiles(acc_tiles, n_rows, n_tokens, y, ldy);
}

// Q6_K: 16 sub-blocks of 16 with signed 8-bit scales sc_j and an offset of 32. With e_j = sc_j +
// 128 = d0 + 4 d1 + 16 d2 + 64 d3 (digits d_k <= 3), the rows' quants are stored as u * d_k (<= 189,
// unsigned bytes) and once as u, so five accumulators over the whole block (K = 64 per TDPBUSD)
// give isum = C0 + 4 C1 + 16 C2 + 64 C3 - 128 Cu - 32 sum_j sc_j bsum[j], the same integer as qdot.h
// (every partial sum fits int32: |e S| <= 255 * 63 * 127 * 256 < 2^31); the offset term by
// vpdpwssd over int16 pairs. No min.
void gemm_q6_K(const void* w, size_t row_bytes, int n_rows, const void* packed, int64_t n_tokens, int64_t n,
               float* y, int64_t ldy) {
    const int64_t n_blocks = n / QK_K, n_tiles = (n_tokens + kAmxTokens - 1) / kAmxTokens;
    constexpr int kParts = 5;  // u * d0, u * d1, u * d2, u * d3, u
    alignas(64) uint8_t a[kParts][kAmxRows][QK_K];
    alignas(64) int32_t c[kParts][kAmxRows][kAmxTokens];
    int32_t sc_pairs[kAmxRows][QK_K / 32];
    float d[kAmxRows];
    std::memset(a, 0, sizeof(a));  // rows past n_rows: zero quants, never read back
    float* acc_tiles = zeroed_accumulators(n_tiles);
    load_tile_config(7);  // 0-4: C per part; 5: A; 6: B
    const __m256i low4 = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03);
    for (int64_t ib = 0; ib < n_blocks; ++ib) {
        for (int r = 0; r < n_rows; ++r) {
            const block_q6_K& b =
                reinterpret_cast<const block_q6_K*>(static_cast<const uint8_t*>(w) + r * row_bytes)[ib];
            // Elements 128h + 32c .. + 31 (c = 0..3): low or high nibbles of ql, bits 2c, 2c + 1
            // of qh on top (qdot_simd.h's KQ6_K chunks); sub-blocks 8h + 2c and 8h + 2c + 1.
            for (int h = 0; h < 2; ++h) {
                const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.ql + 64 * h));
                const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.ql + 64 * h + 32));
                const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh + 32 * h));
                const __m256i lows[4] = {_mm256_and_si256(l0, low4), _mm256_and_si256(l1, low4),
                                         _mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                                         _mm256_and_si256(_mm256_srli_epi16(l1, 4), low4)};
                for (int cc = 0; cc < 4; ++cc) {
                    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * cc), two);
                    const __m256i u = _mm256_or_si256(lows[cc], _mm256_slli_epi16(high, 4));
                    const int e_lo = b.scales[8 * h + 2 * cc] + 128,
                              e_hi = b.scales[8 * h + 2 * cc + 1] + 128;
                    uint8_t* at = &a[kParts - 1][r][128 * h + 32 * cc];
                    _mm256_store_si256(reinterpret_cast<__m256i*>(at), u);
                    for (int k = 0; k < 4; ++k) {
                        // Each 16-element half by its own digit; bytes times a digit <= 3 in 16-bit
                        // lanes: no product reaches the high byte.
                        const __m256i digit =
                            _mm256_setr_m128i(_mm_set1_epi16(static_cast<short>((e_lo >> (2 * k)) & 3)),
                                              _mm_set1_epi16(static_cast<short>((e_hi >> (2 * k)) & 3)));
                        _mm256_store_si256(reinterpret_cast<__m256i*>(&a[k][r][128 * h + 32 * cc]),
                                           _mm256_mullo_epi16(u, digit));
                    }
                }
            }
            for (int j = 0; j < QK_K / 32; ++j)
                sc_pairs[r][j] = int16_pair(b.scales[2 * j], b.scales[2 * j + 1]);
            d[r] = fp16_to_fp32(b.d);
        }
        for (int64_t tile = 0; tile < n_tiles; ++tile) {
            const PackedBlock& p = static_cast<const PackedBlock*>(packed)[tile * n_blocks + ib];
            float* acc = acc_tiles + tile * kAmxRows * kAmxTokens;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            _tile_zero(4);
            for (int k = 0; k < QK_K / 64; ++k) {
                _tile_loadd(6, &p.b[16 * k][0], kAmxTokens * 4);
                _tile_loadd(5, a[0][0] + 64 * k, QK_K);
                _tile_dpbusd(0, 5, 6);
                _tile_loadd(5, a[1][0] + 64 * k, QK_K);
                _tile_dpbusd(1, 5, 6);
                _tile_loadd(5, a[2][0] + 64 * k, QK_K);
                _tile_dpbusd(2, 5, 6);
                _tile_loadd(5, a[3][0] + 64 * k, QK_K);
                _tile_dpbusd(3, 5, 6);
                _tile_loadd(5, a[4][0] + 64 * k, QK_K);
                _tile_dpbusd(4, 5, 6);
            }
            _tile_stored(0, c[0], kAmxTokens * 4);
            _tile_stored(1, c[1], kAmxTokens * 4);
            _tile_stored(2, c[2], kAmxTokens * 4);
            _tile_stored(3, c[3], kAmxTokens * 4);
            _tile_stored(4, c[4], kAmxTokens * 4);
            const __m512 dx = _mm512_loadu_ps(p.dx);
            for (int r = 0; r < n_rows; ++r) {
                __m512i isum = _mm512_load_si512(c[0][r]);
                isum = _mm512_add_epi32(isum, _mm512_slli_epi32(_mm512_load_si512(c[1][r]), 2));
                isum = _mm512_add_epi32(isum, _mm512_slli_epi32(_mm512_load_si512(c[2][r]), 4));
                isum = _mm512_add_epi32(isum, _mm512_slli_epi32(_mm512_load_si512(c[3][r]), 6));
                isum = _mm512_sub_epi32(isum, _mm512_slli_epi32(_mm512_load_si512(c[4][r]), 7));
                __m512i offset = _mm512_setzero_si512();
                for (int j = 0; j < QK_K / 32; ++j)
                    offset = _mm512_dpwssd_epi32(offset, _mm512_set1_epi32(sc_pairs[r][j]),
                                                 _mm512_loadu_si512(p.bsum16_pairs[j]));
                isum = _mm512_sub_epi32(isum, _mm512_slli_epi32(offset, 5));
                // qdot.h's order: acc = acc + (dx * d) * float(isum).
                const __m512 term =
                    _mm512_mul_ps(_mm512_mul_ps(dx, _mm512_set1_ps(d[r])), _mm512_cvtepi32_ps(isum));
                _mm512_storeu_ps(acc + r * kAmxTokens,
                                 _mm512_add_ps(_mm512_loadu_ps(acc + r * kAmxTokens), term));
            }
        }
    }
    _tile_release();
    store_tiles(acc_tiles, n_rows, n_tokens, y, ldy);
}

constexpr AmxKernels kAmxQ4K{packed_bytes, q8_K_pack, gemm_q4_K};
constexpr AmxKernels kAmxQ6K{packed_bytes, q8_K_pack, gemm_q6_K};

}  // namespace

const AmxKernels* amx_kernels_for(GgmlType weight) {
    switch (weight) {
        case GgmlType::Q4_K:
            return &kAmxQ4K;
        case GgmlType::Q6_K:
            return &kAmxQ6K;
        default:
            return nullptr;
    }
}

}  // namespace sharpi::cpu::detail
