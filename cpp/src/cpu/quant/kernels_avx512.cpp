// AVX-512 (F, BW, VL, DQ) kernels. Compiled with AVX-512 flags; dispatch.cpp calls into this file
// only when CPUID reports all four extensions. Everything here has internal linkage (anonymous
// namespace) and uses only intrinsics and libc: see kernels_impl.h on the ODR hazard.
//
// Accumulation layout of this ISA: four accumulators of 16 f32 lanes; chunk c of a row (elements
// 16c .. 16c + 15) is multiplied and added, with one FMA, into accumulator c % 4, chunks in
// increasing order; the accumulators are combined by reduce() in one fixed order. dot_f32 and
// every dot_row follow it, and each type has ONE block decoder that both dequant_row (StoreSink)
// and dot_row (DotSink) call, so dot_row(w, x) == dot_f32(dequant_row(w), x) bit for bit.
//
// Decoding: every 4-bit and 5-bit type, and Q2_K/Q3_K, has at most 32 distinct values per
// sub-block, so the decoder builds the sub-block's value table (16 or 32 floats, computed with the
// same roundings as the gguf package) and looks each element up with one vpermps/vpermi2ps on its
// quant bits. That replaces convert + multiply + add per element by one shuffle, and gives values
// identical to the scalar reference. Q8_0 and Q6_K (256 and 64 values) convert and scale instead.
#include "cpu/quant/iq_unpack.h"
#include "cpu/quant/kernels_impl.h"

// GCC 12 reports the deliberately undefined vectors inside its own AVX-512 intrinsics
// (_mm512_undefined_ps(), used by casts and conversions) as uninitialized wherever they are
// inlined (GCC bug 105593, fixed in 12.3 / 13). The header's own suppression does not reach
// the inlining site, so it is repeated for this file.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <immintrin.h>

namespace sharpi::cpu::detail {
namespace {

constexpr int kChunk = 16;  // f32 lanes per vector

// ---- accumulation -------------------------------------------------------------------------------

inline float reduce(const __m512 acc[4]) {
    const __m512 s16 = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(s16), _mm512_extractf32x8_ps(s16, 1));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    const __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
    return _mm_cvtss_f32(s1);
}

// Sinks receive the decoded chunks of a block: `chunk` counts 16-element chunks from the start of
// the 64-element group that the current block begins (0 for every K-quant block).
struct StoreSink {
    float* dst;
    void put(int chunk, __m512 w) { _mm512_storeu_ps(dst + kChunk * chunk, w); }
};

struct DotSink {
    const float* x;  // activations at the start of the current group
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    void put(int chunk, __m512 w) {
        acc[chunk & 3] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + kChunk * chunk), acc[chunk & 3]);
    }
};

// dequant_row / dot_row of a block type, from its decoder D (D::Block, D::kBlockSize,
// D::decode(block, sink, first_chunk)). A block of 32 is two chunks: blocks are decoded in pairs
// so that accumulator indices stay compile-time constants, and an odd last block takes
// accumulators 0 and 1, exactly like dot_f32's tail.
template <typename D>
void dequant_row_blocks(const void* src, float* dst, int64_t n) {
    const typename D::Block* blocks = static_cast<const typename D::Block*>(src);
    for (int64_t ib = 0; ib < n / D::kBlockSize; ++ib) {
        StoreSink sink{dst + ib * D::kBlockSize};
        D::decode(blocks + ib, sink, 0);
    }
}

template <typename D>
float dot_row_blocks(const void* src, const float* x, int64_t n) {
    static_assert(D::kBlockSize == 32 || D::kBlockSize % 64 == 0,
                  "blocks must fill whole chunk groups or pairs");
    const typename D::Block* blocks = static_cast<const typename D::Block*>(src);
    const int64_t nb = n / D::kBlockSize;
    DotSink sink{x};
    int64_t ib = 0;
    if constexpr (D::kBlockSize == 32) {
        for (; ib + 2 <= nb; ib += 2) {
            prefetch_ahead(blocks + ib, 2 * sizeof(typename D::Block));
            sink.x = x + ib * 32;
            D::decode(blocks + ib, sink, 0);
            D::decode(blocks + ib + 1, sink, 2);
        }
    }
    for (; ib < nb; ++ib) {
        prefetch_ahead(blocks + ib, sizeof(typename D::Block));
        sink.x = x + ib * D::kBlockSize;
        D::decode(blocks + ib, sink, 0);
    }
    return reduce(sink.acc);
}

// ---- plain float rows (F32, F16, BF16): any n -------------------------------------------------------

struct LoadF32 {
    static constexpr size_t kBytes = 4;
    static const void* address(const void* p, int64_t i) { return static_cast<const float*>(p) + i; }
    static __m512 full(const void* p, int64_t i) { return _mm512_loadu_ps(static_cast<const float*>(p) + i); }
    static __m512 part(const void* p, int64_t i, __mmask16 m) {
        return _mm512_maskz_loadu_ps(m, static_cast<const float*>(p) + i);
    }
};
struct LoadF16 {
    static constexpr size_t kBytes = 2;
    static const void* address(const void* p, int64_t i) { return static_cast<const uint16_t*>(p) + i; }
    static __m512 full(const void* p, int64_t i) {
        return _mm512_cvtph_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i)));
    }
    static __m512 part(const void* p, int64_t i, __mmask16 m) {
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i));
    }
};
struct LoadBF16 {
    static constexpr size_t kBytes = 2;
    static const void* address(const void* p, int64_t i) { return static_cast<const uint16_t*>(p) + i; }
    static __m512 widen(__m256i h) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    static __m512 full(const void* p, int64_t i) {
        return widen(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i)));
    }
    static __m512 part(const void* p, int64_t i, __mmask16 m) {
        return widen(_mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i));
    }
};

// Main loop four chunks at a time, then whole chunks into accumulators 0, 1, 2 in order, then a
// masked partial chunk; masked-off lanes leave their accumulator untouched.
template <typename Load>
float dot_plain(const void* w, const float* x, int64_t n) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t i = 0;
    for (; i + 4 * kChunk <= n; i += 4 * kChunk) {
        prefetch_ahead(Load::address(w, i), 4 * kChunk * Load::kBytes);
        for (int k = 0; k < 4; ++k) {
            acc[k] =
                _mm512_fmadd_ps(Load::full(w, i + kChunk * k), _mm512_loadu_ps(x + i + kChunk * k), acc[k]);
        }
    }
    int k = 0;
    for (; i + kChunk <= n; i += kChunk, ++k) {
        acc[k] = _mm512_fmadd_ps(Load::full(w, i), _mm512_loadu_ps(x + i), acc[k]);
    }
    if (i < n) {
        const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
        acc[k] = _mm512_mask3_fmadd_ps(Load::part(w, i, m), _mm512_maskz_loadu_ps(m, x + i), acc[k], m);
    }
    return reduce(acc);
}

template <typename Load>
void dequant_plain(const void* w, float* dst, int64_t n) {
    int64_t i = 0;
    for (; i + kChunk <= n; i += kChunk) _mm512_storeu_ps(dst + i, Load::full(w, i));
    if (i < n) {
        const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(dst + i, m, Load::part(w, i, m));
    }
}

float dot_f32_avx512(const float* a, const float* b, int64_t n) {
    return dot_plain<LoadF32>(a, b, n);
}

// R rows x T tokens at once: each (row, token) pair has its own four accumulators fed exactly as
// dot_plain<LoadF32> feeds them (same chunks, same order, same tail), so every result equals
// dot_f32's bit for bit, while each loaded chunk of w serves T tokens and each chunk of x R rows.
// 2 x 3 uses 24 accumulators + 3 operands of the 32 zmm registers.
template <int R, int T>
void dot_f32_micro(const float* w, int64_t ldw, const float* x, int64_t ldx, int64_t n, float* y,
                   int64_t ldy) {
    __m512 acc[R][T][4];
    for (int r = 0; r < R; ++r) {
        for (int t = 0; t < T; ++t) {
            for (int k = 0; k < 4; ++k) acc[r][t][k] = _mm512_setzero_ps();
        }
    }
    int64_t i = 0;
    for (; i + 4 * kChunk <= n; i += 4 * kChunk) {
        for (int k = 0; k < 4; ++k) {
            __m512 wv[R];
            for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_ps(w + r * ldw + i + kChunk * k);
            for (int t = 0; t < T; ++t) {
                const __m512 xv = _mm512_loadu_ps(x + t * ldx + i + kChunk * k);
                for (int r = 0; r < R; ++r) acc[r][t][k] = _mm512_fmadd_ps(wv[r], xv, acc[r][t][k]);
            }
        }
    }
    // Tail as in dot_plain: whole chunks into accumulators 0, 1, 2, then a masked partial chunk.
    for (int k = 0; k < 4 && i < n; ++k) {
        const __mmask16 m =
            (n - i >= kChunk) ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1u);
        for (int t = 0; t < T; ++t) {
            const __m512 xv = _mm512_maskz_loadu_ps(m, x + t * ldx + i);
            for (int r = 0; r < R; ++r) {
                acc[r][t][k] =
                    _mm512_mask3_fmadd_ps(_mm512_maskz_loadu_ps(m, w + r * ldw + i), xv, acc[r][t][k], m);
            }
        }
        i += (n - i >= kChunk) ? kChunk : n - i;
    }
    for (int t = 0; t < T; ++t) {
        for (int r = 0; r < R; ++r) y[t * ldy + r] = reduce(acc[r][t]);
    }
}

template <int T>
void dot_f32_rows(const float* w, int64_t ldw, int64_t n_rows, const float* x, int64_t ldx, int64_t n,
                  float* y, int64_t ldy) {
    int64_t r = 0;
    for (; r + 2 <= n_rows; r += 2) dot_f32_micro<2, T>(w + r * ldw, ldw, x, ldx, n, y + r, ldy);
    if (r < n_rows) dot_f32_micro<1, T>(w + r * ldw, ldw, x, ldx, n, y + r, ldy);
}

void dot_f32_tile_avx512(const float* w, int64_t ldw, int64_t n_rows, const float* x, int64_t ldx,
                         int64_t n_tokens, int64_t n, float* y, int64_t ldy) {
    int64_t t = 0;
    for (; t + 3 <= n_tokens; t += 3) dot_f32_rows<3>(w, ldw, n_rows, x + t * ldx, ldx, n, y + t * ldy, ldy);
    if (n_tokens - t == 2) dot_f32_rows<2>(w, ldw, n_rows, x + t * ldx, ldx, n, y + t * ldy, ldy);
    if (n_tokens - t == 1) dot_f32_rows<1>(w, ldw, n_rows, x + t * ldx, ldx, n, y + t * ldy, ldy);
}

// ---- decoding helpers ---------------------------------------------------------------------------

inline float half_to_float(uint16_t h) {
    return _cvtsh_ss(h);
}

inline __m512 iota16() {
    return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
inline __m512 iota16_from(float first) {
    return _mm512_add_ps(iota16(), _mm512_set1_ps(first));
}

// 16 consecutive bytes widened to 16 dword lanes (the lookup indices).
inline __m512i bytes_to_lanes(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// vpternlog truth tables are built from these operand patterns.
constexpr int kTernA = 0xF0, kTernB = 0xCC, kTernC = 0xAA;
// Per bit: mask ? a : b.
inline __m512i bitselect(__m512i mask, __m512i a, __m512i b) {
    return _mm512_ternarylogic_epi32(a, b, mask, (kTernA & kTernC) | (kTernB & ~kTernC & 0xFF));
}
// Shift every dword left by s (right by -s when s < 0); s is a compile-time constant after inlining.
inline __m512i shift_left(__m512i v, int s) {
    if (s > 0) return _mm512_slli_epi32(v, static_cast<unsigned>(s));
    if (s < 0) return _mm512_srli_epi32(v, static_cast<unsigned>(-s));
    return v;
}

// Q4_K / Q5_K scales: out[0..7] = d * sc[j], out[8..15] = dmin * m[j] (one rounding each, as numpy).
inline void q4_K_scales(const uint8_t* packed, uint16_t d_half, uint16_t dmin_half, float (&out)[16]) {
    const Q4KScaleWords w = unpack_q4_K_scale_min(packed);
    const __m128i bytes = _mm_set_epi32(static_cast<int>(w.m_hi), static_cast<int>(w.m_lo),
                                        static_cast<int>(w.sc_hi), static_cast<int>(w.sc_lo));
    const __m512 values = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
    const __m512 factor = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(half_to_float(d_half)),
                                               _mm512_set1_ps(half_to_float(dmin_half)));
    _mm512_storeu_ps(out, _mm512_mul_ps(factor, values));
    keep_in_memory(out);
}

// ---- block decoders -----------------------------------------------------------------------------

// Q4_0: T[q] = d * (q - 8). Lane i of the widened qs bytes indexes with its low nibble (element i)
// or, shifted, its high nibble (element 16 + i); vpermps reads only the low 4 index bits.
struct DecodeQ4_0 {
    using Block = block_q4_0;
    static constexpr int kBlockSize = QK4_0;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink, int c0) {
        const __m512 table = _mm512_mul_ps(_mm512_set1_ps(half_to_float(b->d)), iota16_from(-8.0f));
        const __m512i q = bytes_to_lanes(b->qs);
        sink.put(c0, _mm512_permutexvar_ps(q, table));
        sink.put(c0 + 1, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table));
    }
};

// Q4_1: T[q] = d * q + m.
struct DecodeQ4_1 {
    using Block = block_q4_1;
    static constexpr int kBlockSize = QK4_1;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink, int c0) {
        const __m512 table = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(half_to_float(b->d)), iota16()),
                                           _mm512_set1_ps(half_to_float(b->m)));
        const __m512i q = bytes_to_lanes(b->qs);
        sink.put(c0, _mm512_permutexvar_ps(q, table));
        sink.put(c0 + 1, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table));
    }
};

// Q5_0 / Q5_1: 32-entry tables (low: q < 16, high: q >= 16); the fifth bit of element j is bit j
// of qh, used directly as a lane mask that sets index bit 4.
// MXFP4: T[q] = scale * kMxfp4Values[q] (exact products), indexed like Q4_0.
struct DecodeMX4 {
    using Block = block_mxfp4;
    static constexpr int kBlockSize = QK_MXFP4;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink, int c0) {
        const __m512 values = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(kMxfp4Values))));
        const __m512 table = _mm512_mul_ps(_mm512_set1_ps(mxfp4_scale(b->e)), values);
        const __m512i q = bytes_to_lanes(b->qs);
        sink.put(c0, _mm512_permutexvar_ps(q, table));
        sink.put(c0 + 1, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table));
    }
};

inline uint32_t load_u32(const uint8_t* p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

template <typename Sink>
inline void decode_q5_lanes(const uint8_t* qs, uint32_t qh, __m512 table_lo, __m512 table_hi, Sink& sink,
                            int c0) {
    const __m512i q = bytes_to_lanes(qs);
    const __m512i bit4 = _mm512_set1_epi32(0x10);
    const __m512i idx_lo = _mm512_and_si512(q, _mm512_set1_epi32(0x0F));
    const __m512i idx_hi = _mm512_srli_epi32(q, 4);
    const __mmask16 high_lo = static_cast<__mmask16>(qh & 0xFFFFu),
                    high_hi = static_cast<__mmask16>(qh >> 16);
    sink.put(c0,
             _mm512_permutex2var_ps(table_lo, _mm512_mask_or_epi32(idx_lo, high_lo, idx_lo, bit4), table_hi));
    sink.put(c0 + 1,
             _mm512_permutex2var_ps(table_lo, _mm512_mask_or_epi32(idx_hi, high_hi, idx_hi, bit4), table_hi));
}

struct DecodeQ5_0 {  // T[q] = d * (q - 16)
    using Block = block_q5_0;
    static constexpr int kBlockSize = QK5_0;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink, int c0) {
        const __m512 d = _mm512_set1_ps(half_to_float(b->d));
        decode_q5_lanes(b->qs, load_u32(b->qh), _mm512_mul_ps(d, iota16_from(-16.0f)),
                        _mm512_mul_ps(d, iota16()), sink, c0);
    }
};

struct DecodeQ5_1 {  // T[q] = d * q + m
    using Block = block_q5_1;
    static constexpr int kBlockSize = QK5_1;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink, int c0) {
        const __m512 d = _mm512_set1_ps(half_to_float(b->d)), m = _mm512_set1_ps(half_to_float(b->m));
        decode_q5_lanes(b->qs, load_u32(b->qh), _mm512_add_ps(_mm512_mul_ps(d, iota16()), m),
                        _mm512_add_ps(_mm512_mul_ps(d, iota16_from(16.0f)), m), sink, c0);
    }
};

// Q8_0: float(q) * d.
struct DecodeQ8_0 {
    using Block = block_q8_0;
    static constexpr int kBlockSize = QK8_0;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink, int c0) {
        const __m512 d = _mm512_set1_ps(half_to_float(b->d));
        for (int c = 0; c < 2; ++c) {
            const __m512i q =
                _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b->qs + 16 * c)));
            sink.put(c0 + c, _mm512_mul_ps(_mm512_cvtepi32_ps(q), d));
        }
    }
};

// Q2_K: sub-block s = 8h + 2j + l is exactly chunk s. T[k] = dl * (k & 3) - ml: the index is the qs
// byte shifted right by 2j, whose bits 3:2 (the next element's bits) select a repeat of the table.
struct DecodeQ2_K {
    using Block = block_q2_K;
    static constexpr int kBlockSize = QK_K;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink, int) {
        alignas(64) float dl[16], ml[16];
        const __m512i sc = bytes_to_lanes(b->scales);
        _mm512_store_ps(dl, _mm512_mul_ps(_mm512_set1_ps(half_to_float(b->d)),
                                          _mm512_cvtepi32_ps(_mm512_and_si512(sc, _mm512_set1_epi32(0x0F)))));
        _mm512_store_ps(ml, _mm512_mul_ps(_mm512_set1_ps(half_to_float(b->dmin)),
                                          _mm512_cvtepi32_ps(_mm512_srli_epi32(sc, 4))));
        keep_in_memory(dl);
        keep_in_memory(ml);
        const __m512 q_values = _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
        for (int h = 0; h < 2; ++h) {
            const __m512i q[2] = {bytes_to_lanes(b->qs + 32 * h), bytes_to_lanes(b->qs + 32 * h + 16)};
            for (int j = 0; j < 4; ++j) {
                for (int l = 0; l < 2; ++l) {
                    const int s = 8 * h + 2 * j + l;
                    const __m512 table =
                        _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(dl[s]), q_values), _mm512_set1_ps(ml[s]));
                    sink.put(s, _mm512_permutexvar_ps(shift_left(q[l], -2 * j), table));
                }
            }
        }
    }
};

// Q3_K: sub-block s = 8h + 2j + l is chunk s. Index bits 1:0 = the 2 low bits (qs >> 2j), bit 2 =
// the hmask bit (hmask >> (4h + j)); T[k] = dl * ((k & 7) - 4) (bit 3 of the index is junk and
// selects a repeat). k & 7 = low + 4 * high, so (k & 7) - 4 = low - (high ? 0 : 4).
struct DecodeQ3_K {
    using Block = block_q3_K;
    static constexpr int kBlockSize = QK_K;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink, int) {
        alignas(64) float dl[16];
        uint32_t biased[4];
        unpack_q3_K_scales(b->scales, biased);
        const __m512i scales = _mm512_sub_epi32(
            _mm512_cvtepu8_epi32(_mm_set_epi32(static_cast<int>(biased[3]), static_cast<int>(biased[2]),
                                               static_cast<int>(biased[1]), static_cast<int>(biased[0]))),
            _mm512_set1_epi32(32));
        _mm512_store_ps(dl, _mm512_mul_ps(_mm512_set1_ps(half_to_float(b->d)), _mm512_cvtepi32_ps(scales)));
        keep_in_memory(dl);
        const __m512 q_values = _mm512_setr_ps(-4, -3, -2, -1, 0, 1, 2, 3, -4, -3, -2, -1, 0, 1, 2, 3);
        const __m512i low_bits = _mm512_set1_epi32(0x03);
        const __m512i hm[2] = {bytes_to_lanes(b->hmask), bytes_to_lanes(b->hmask + 16)};
        for (int h = 0; h < 2; ++h) {
            const __m512i q[2] = {bytes_to_lanes(b->qs + 32 * h), bytes_to_lanes(b->qs + 32 * h + 16)};
            for (int j = 0; j < 4; ++j) {
                for (int l = 0; l < 2; ++l) {
                    const int s = 8 * h + 2 * j + l;
                    const __m512i idx =
                        bitselect(low_bits, shift_left(q[l], -2 * j), shift_left(hm[l], 2 - (4 * h + j)));
                    sink.put(s, _mm512_permutexvar_ps(idx, _mm512_mul_ps(_mm512_set1_ps(dl[s]), q_values)));
                }
            }
        }
    }
};

// Q4_K: group j (64 elements) = sub-block 2j (low nibbles of qs[32j..32j+31], chunks 4j, 4j+1)
// and sub-block 2j+1 (high nibbles, chunks 4j+2, 4j+3). T[q] = (d * sc) * q - dmin * m.
struct DecodeQ4_K {
    using Block = block_q4_K;
    static constexpr int kBlockSize = QK_K;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink, int) {
        alignas(64) float scale_min[16];
        q4_K_scales(b->scales, b->d, b->dmin, scale_min);
        for (int j = 0; j < 4; ++j) {
            const __m512 table_lo = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(scale_min[2 * j]), iota16()),
                                                  _mm512_set1_ps(scale_min[8 + 2 * j]));
            const __m512 table_hi =
                _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(scale_min[2 * j + 1]), iota16()),
                              _mm512_set1_ps(scale_min[8 + 2 * j + 1]));
            const __m512i q0 = bytes_to_lanes(b->qs + 32 * j), q1 = bytes_to_lanes(b->qs + 32 * j + 16);
            sink.put(4 * j + 0, _mm512_permutexvar_ps(q0, table_lo));
            sink.put(4 * j + 1, _mm512_permutexvar_ps(q1, table_lo));
            sink.put(4 * j + 2, _mm512_permutexvar_ps(_mm512_srli_epi32(q0, 4), table_hi));
            sink.put(4 * j + 3, _mm512_permutexvar_ps(_mm512_srli_epi32(q1, 4), table_hi));
        }
    }
};

// Q5_K: as Q4_K with 32-entry tables; index bit 4 is qh[i] bit 2j (low nibbles) or 2j+1 (high).
struct DecodeQ5_K {
    using Block = block_q5_K;
    static constexpr int kBlockSize = QK_K;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink, int) {
        alignas(64) float scale_min[16];
        q4_K_scales(b->scales, b->d, b->dmin, scale_min);
        const __m512i nibble = _mm512_set1_epi32(0x0F);
        const __m512i qh0 = bytes_to_lanes(b->qh), qh1 = bytes_to_lanes(b->qh + 16);
        for (int j = 0; j < 4; ++j) {
            __m512 table[2][2];  // [sub-block 2j + t][q < 16, q >= 16]
            for (int t = 0; t < 2; ++t) {
                const __m512 dsc = _mm512_set1_ps(scale_min[2 * j + t]),
                             dm = _mm512_set1_ps(scale_min[8 + 2 * j + t]);
                table[t][0] = _mm512_sub_ps(_mm512_mul_ps(dsc, iota16()), dm);
                table[t][1] = _mm512_sub_ps(_mm512_mul_ps(dsc, iota16_from(16.0f)), dm);
            }
            const __m512i q0 = bytes_to_lanes(b->qs + 32 * j), q1 = bytes_to_lanes(b->qs + 32 * j + 16);
            const int lo_bit = 2 * j, hi_bit = 2 * j + 1;
            const __m512i idx[4] = {
                bitselect(nibble, q0, shift_left(qh0, 4 - lo_bit)),
                bitselect(nibble, q1, shift_left(qh1, 4 - lo_bit)),
                bitselect(nibble, _mm512_srli_epi32(q0, 4), shift_left(qh0, 4 - hi_bit)),
                bitselect(nibble, _mm512_srli_epi32(q1, 4), shift_left(qh1, 4 - hi_bit)),
            };
            for (int c = 0; c < 4; ++c) {
                const int t = c / 2;
                sink.put(4 * j + c, _mm512_permutex2var_ps(table[t][0], idx[c], table[t][1]));
            }
        }
    }
};

// Q6_K: q is assembled 64 elements at a time with byte operations (see the scalar reference for
// the bit layout), biased to q - 32, parked in a stack buffer and widened 16 at a time;
// value = (d * scales[chunk]) * (q - 32).
struct DecodeQ6_K {
    using Block = block_q6_K;
    static constexpr int kBlockSize = QK_K;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink, int) {
        alignas(64) float dsc[16];
        alignas(64) int8_t q[128];
        _mm512_store_ps(dsc, _mm512_mul_ps(_mm512_set1_ps(half_to_float(b->d)),
                                           _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                               reinterpret_cast<const __m128i*>(b->scales))))));
        keep_in_memory(dsc);
        const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30),
                      bias = _mm512_set1_epi8(32);
        // Shift counts per 16-bit lane: first 256 bits (elements 32k + i, k even) vs second (k odd).
        const __m512i shift_first =
            _mm512_set_epi64(0x0002000200020002, 0x0002000200020002, 0x0002000200020002, 0x0002000200020002,
                             0x0004000400040004, 0x0004000400040004, 0x0004000400040004, 0x0004000400040004);
        const __m512i shift_second = _mm512_set_epi64(0x0002000200020002, 0x0002000200020002,
                                                      0x0002000200020002, 0x0002000200020002, 0, 0, 0, 0);
        constexpr int bits_or_b = (kTernA & kTernC) | kTernB;  // (a & c) | b
        for (int h = 0; h < 2; ++h) {
            const __m512i ql = _mm512_loadu_si512(b->ql + 64 * h);
            const __m512i qh =
                _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qh + 32 * h)));
            // Elements 0..63 of the half: low nibbles; qh bits 0-1 (first 32) and 2-3 (next 32) to bits 4-5.
            const __m512i high_a = _mm512_and_si512(_mm512_sllv_epi16(qh, shift_first), bits45);
            const __m512i q_a = _mm512_sub_epi8(_mm512_ternarylogic_epi32(ql, high_a, low4, bits_or_b), bias);
            // Elements 64..127: high nibbles; qh bits 4-5 and 6-7 to bits 4-5.
            const __m512i high_b = _mm512_and_si512(_mm512_srlv_epi16(qh, shift_second), bits45);
            const __m512i q_b = _mm512_sub_epi8(
                _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), high_b, low4, bits_or_b), bias);
            _mm512_store_si512(q, q_a);
            _mm512_store_si512(q + 64, q_b);
            for (int c = 0; c < 8; ++c) {
                const __m512i qi =
                    _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q + 16 * c)));
                sink.put(8 * h + c, _mm512_mul_ps(_mm512_set1_ps(dsc[8 * h + c]), _mm512_cvtepi32_ps(qi)));
            }
        }
    }
};

// ---- IQ types (iq_unpack.h): values (d * sc) * q, every product exact --------------------------

// IQ4_NL / IQ4_XS: T[q] = scale * kIq4nlValues[q], looked up as in Q4_0.
inline __m512 iq4_table(float scale) {
    const __m128i kv = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nlValues));
    return _mm512_mul_ps(_mm512_set1_ps(scale), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(kv)));
}

struct DecodeIQ4_NL {
    using Block = block_iq4_nl;
    static constexpr int kBlockSize = QK4_NL;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink, int c0) {
        const __m512 table = iq4_table(half_to_float(b->d));
        const __m512i q = bytes_to_lanes(b->qs);
        sink.put(c0, _mm512_permutexvar_ps(q, table));
        sink.put(c0 + 1, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table));
    }
};

struct DecodeIQ4_XS {
    using Block = block_iq4_xs;
    static constexpr int kBlockSize = QK_K;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink, int) {
        const float d = half_to_float(b->d);
        for (int ib = 0; ib < QK_K / 32; ++ib) {
            const __m512 table = iq4_table(d * static_cast<float>(iq4_xs_scale(b, ib)));
            const __m512i q = bytes_to_lanes(b->qs + 16 * ib);
            sink.put(2 * ib, _mm512_permutexvar_ps(q, table));
            sink.put(2 * ib + 1, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table));
        }
    }
};

// The lattice types: grid lookups into an IqUnpacked, then 16 floats per chunk (one scale each).
template <typename B, void (*Unpack)(const B*, IqUnpacked&)>
struct DecodeIqGrid {
    using Block = B;
    static constexpr int kBlockSize = QK_K;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink, int) {
        alignas(64) IqUnpacked u;
        Unpack(b, u);
        for (int c = 0; c < QK_K / 16; ++c) {
            const __m512 scale = _mm512_set1_ps(u.d * static_cast<float>(u.sc[c]));
            const __m512i q =
                _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u.q + 16 * c)));
            sink.put(c, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(q)));
        }
    }
};

SHARPI_SIMD_KERNEL_TABLE(kAvx512Kernels, dot_f32_avx512, dot_f32_tile_avx512)

}  // namespace

const IsaKernels& avx512_kernels() {
    return kAvx512Kernels;
}

}  // namespace sharpi::cpu::detail
