// Fast-mode prefill on Intel AMX-INT8 tiles (qdot.h's AmxKernels): Q4_K and Q6_K weights x q8_K
// activations, the arithmetic of qdot.h bit for bit.
//
// Per 256-element block, qdot.h's sums are isum = sum_j sc[j] * S[j] (- 32 * sum_j sc[j] *
// bsum[j] for Q6_K's offset) and, for Q4_K, imin = sum_j mn[j] * bsum[j], over the sub-blocks j
// that share a scale (Q4_K: 8 of 32 elements; Q6_K: 16 of 16), with S[j] = sum_{i in j} u_i * q_i
// (u the unsigned quants, q the activations) and bsum[j] the activations' sum over j. Integer sums
// are exact in any order, so the tiles may form them: one TDPBUSD per sub-block gives S[j] for 16
// rows x 16 tokens (A: the rows' unpacked quants, 16 x K bytes; B: the tokens' activations in the
// VNNI layout, K / 4 x 64 bytes). AVX-512 then weighs the S tiles by the rows' scales and runs
// qdot.h's float steps per (row, token), 16 tokens to a vector: acc += (dx * d) * float(isum);
// acc -= (dx * dmin) * float(imin) (Q4_K), blocks in order from acc = 0. Multiplication commutes
// bit for bit, so (d * dx) in a lane equals the scalar (dx * d), and every (row, token) gets
// exactly its vec_dot.
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

// Tile registers: 0-3 the S tiles of four sub-blocks, 4 and 5 A (weights), 6 and 7 B (activations).
struct alignas(64) TileConfig {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Tiles for sub-blocks of k elements.
void load_tile_config(int k) {
    TileConfig cfg;
    std::memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < 4; ++t) {
        cfg.rows[t] = kAmxRows;
        cfg.colsb[t] = kAmxTokens * 4;  // int32 per token
    }
    for (int t = 4; t < 6; ++t) {
        cfg.rows[t] = kAmxRows;
        cfg.colsb[t] = static_cast<uint16_t>(k);  // one sub-block of unpacked quants per row
    }
    for (int t = 6; t < 8; ++t) {
        cfg.rows[t] = static_cast<uint8_t>(k / 4);
        cfg.colsb[t] = kAmxTokens * 4;  // 4 activation bytes per token
    }
    _tile_loadconfig(&cfg);
}

// The activations of up to 16 tokens for every block, packed once and read by every row tile:
// per block, the B rows (row k holds, for each token t, the 4 bytes q_t[4k .. 4k + 3]: the B tile
// of a sub-block of K elements starting at element e is the K / 4 rows from e / 4), then the
// tokens' dx [16] and 16-element sums bsum [16][16] (int32).
struct PackedBlock {
    int8_t b[QK_K / 4][kAmxTokens * 4];
    float dx[kAmxTokens];
    int32_t bsum[QK_K / 16][kAmxTokens];
    // Q4_K's 32-element sums two sub-blocks to an int32 (int16 pairs: 2j low, 2j + 1 high; each
    // |sum| <= 32 * 127 fits), for vpdpwssd against the mins.
    int32_t bsum32_pairs[QK_K / 64][kAmxTokens];
};

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
            for (int j = 0; j < QK_K / 16; ++j) p.bsum[j][t] = x.bsums[j];
            for (int j = 0; j < QK_K / 64; ++j) {
                const int32_t even = x.bsums[4 * j] + x.bsums[4 * j + 1];
                const int32_t odd = x.bsums[4 * j + 2] + x.bsums[4 * j + 3];
                p.bsum32_pairs[j][t] = static_cast<int32_t>((static_cast<uint32_t>(odd) << 16) |
                                                            (static_cast<uint32_t>(even) & 0xFFFFu));
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
    TileConfig cfg;
    std::memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < 5; ++t) {  // 0, 1: C hi / lo; 2, 3: A hi / lo; 4: B (64 elements)
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
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

// Q6_K: 16 sub-blocks of 16 with signed 8-bit scales, each its own S tile (K = 16), weighed by
// AVX-512; isum = sum_j sc_j S[j] - 32 sum_j sc_j bsum[j] (the offset), no min.
struct RowScales {
    int32_t sc[16];
    float d;
};

// Elements 128h + 32c .. + 31 (c = 0..3) are sub-blocks 8h + 2c and 8h + 2c + 1 (qdot_simd.h's
// KQ6_K chunks): low or high nibbles of ql, bits 2c, 2c + 1 of qh on top.
void unpack_q6_K(const block_q6_K& b, uint8_t (*a)[kAmxRows][16], int r, RowScales& s) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03);
    for (int h = 0; h < 2; ++h) {
        const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.ql + 64 * h));
        const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.ql + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh + 32 * h));
        const __m256i lows[4] = {_mm256_and_si256(l0, low4), _mm256_and_si256(l1, low4),
                                 _mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                                 _mm256_and_si256(_mm256_srli_epi16(l1, 4), low4)};
        for (int c = 0; c < 4; ++c) {
            const __m256i high = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), two);
            const __m256i u = _mm256_or_si256(lows[c], _mm256_slli_epi16(high, 4));
            _mm_store_si128(reinterpret_cast<__m128i*>(a[8 * h + 2 * c][r]), _mm256_castsi256_si128(u));
            _mm_store_si128(reinterpret_cast<__m128i*>(a[8 * h + 2 * c + 1][r]),
                            _mm256_extracti128_si256(u, 1));
        }
    }
    for (int j = 0; j < 16; ++j) s.sc[j] = b.scales[j];
    s.d = fp16_to_fp32(b.d);
}

void gemm_q6_K(const void* w, size_t row_bytes, int n_rows, const void* packed, int64_t n_tokens, int64_t n,
               float* y, int64_t ldy) {
    constexpr int K = 16, kSubs = QK_K / K;
    const int64_t n_blocks = n / QK_K, n_tiles = (n_tokens + kAmxTokens - 1) / kAmxTokens;
    alignas(64) uint8_t a[kSubs][kAmxRows][K];  // the rows' unpacked quants per sub-block
    alignas(64) int32_t s_tile[kSubs][kAmxRows][kAmxTokens];
    RowScales scales[kAmxRows];
    std::memset(a, 0, sizeof(a));  // rows past n_rows: zero quants, never read back
    float* acc_tiles = zeroed_accumulators(n_tiles);
    load_tile_config(K);
    for (int64_t ib = 0; ib < n_blocks; ++ib) {
        for (int r = 0; r < n_rows; ++r) {
            const block_q6_K& b =
                reinterpret_cast<const block_q6_K*>(static_cast<const uint8_t*>(w) + r * row_bytes)[ib];
            unpack_q6_K(b, a, r, scales[r]);
        }
        for (int64_t tile = 0; tile < n_tiles; ++tile) {
            const PackedBlock& p = static_cast<const PackedBlock*>(packed)[tile * n_blocks + ib];
            float* acc = acc_tiles + tile * kAmxRows * kAmxTokens;
            const int8_t* b_rows = &p.b[0][0];
            constexpr int kBStride = kAmxTokens * 4, kBRowsPerSub = K / 4;
            for (int j0 = 0; j0 < kSubs; j0 += 4) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                _tile_loadd(4, a[j0], K);
                _tile_loadd(6, b_rows + j0 * kBRowsPerSub * kBStride, kBStride);
                _tile_dpbusd(0, 4, 6);
                _tile_loadd(5, a[j0 + 1], K);
                _tile_loadd(7, b_rows + (j0 + 1) * kBRowsPerSub * kBStride, kBStride);
                _tile_dpbusd(1, 5, 7);
                _tile_loadd(4, a[j0 + 2], K);
                _tile_loadd(6, b_rows + (j0 + 2) * kBRowsPerSub * kBStride, kBStride);
                _tile_dpbusd(2, 4, 6);
                _tile_loadd(5, a[j0 + 3], K);
                _tile_loadd(7, b_rows + (j0 + 3) * kBRowsPerSub * kBStride, kBStride);
                _tile_dpbusd(3, 5, 7);
                _tile_stored(0, s_tile[j0], kBStride);
                _tile_stored(1, s_tile[j0 + 1], kBStride);
                _tile_stored(2, s_tile[j0 + 2], kBStride);
                _tile_stored(3, s_tile[j0 + 3], kBStride);
            }
            const __m512 dx = _mm512_loadu_ps(p.dx);
            for (int r = 0; r < n_rows; ++r) {
                __m512i isum = _mm512_setzero_si512(), offset = _mm512_setzero_si512();
                for (int j = 0; j < kSubs; ++j) {
                    const __m512i sc = _mm512_set1_epi32(scales[r].sc[j]);
                    isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(sc, _mm512_load_si512(s_tile[j][r])));
                    offset = _mm512_add_epi32(offset, _mm512_mullo_epi32(sc, _mm512_loadu_si512(p.bsum[j])));
                }
                isum = _mm512_sub_epi32(isum, _mm512_slli_epi32(offset, 5));
                // qdot.h's order: acc = acc + (dx * d) * float(isum).
                const __m512 term =
                    _mm512_mul_ps(_mm512_mul_ps(dx, _mm512_set1_ps(scales[r].d)), _mm512_cvtepi32_ps(isum));
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
