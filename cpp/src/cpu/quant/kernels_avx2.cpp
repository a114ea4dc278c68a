// AVX2 + FMA + F16C kernels. Compiled with those flags; dispatch.cpp calls into this file only when
// CPUID reports all three. Everything here has internal linkage (anonymous namespace) and uses only
// intrinsics and libc: see kernels_impl.h on the ODR hazard.
//
// Accumulation layout of this ISA: four accumulators of 8 f32 lanes; chunk c of a row (elements
// 8c .. 8c + 7) is multiplied and added, with one FMA, into accumulator c % 4, chunks in increasing
// order; reduce() combines the accumulators in one fixed order. Every block holds a multiple of
// four chunks, so each block starts on accumulator 0. Each type has ONE block decoder that both
// dequant_row (StoreSink) and dot_row (DotSink) call, so dot_row(w, x) == dot_f32(dequant_row(w), x)
// bit for bit.
//
// Decoding: AVX2 has no 16-entry float shuffle, so most types widen their quant bits to dword
// lanes, convert and scale with the gguf package's roundings (multiply, then add or subtract).
// Q2_K and Q3_K have at most 8 values per sub-block and use an 8-entry vpermps table instead.
#include <immintrin.h>

#include "cpu/quant/iq_unpack.h"
#include "cpu/quant/kernels_impl.h"

namespace sharpi::cpu::detail {
namespace {

constexpr int kChunk = 8;  // f32 lanes per vector

// ---- accumulation -------------------------------------------------------------------------------

inline float reduce(const __m256 acc[4]) {
    const __m256 s8 = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    const __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
    return _mm_cvtss_f32(s1);
}

// Sinks receive the decoded 8-element chunks of a block, numbered from the block's start.
struct StoreSink {
    float* dst;
    void put(int chunk, __m256 w) { _mm256_storeu_ps(dst + kChunk * chunk, w); }
};

struct DotSink {
    const float* x;  // activations at the start of the current block
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    void put(int chunk, __m256 w) {
        acc[chunk & 3] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + kChunk * chunk), acc[chunk & 3]);
    }
};

template <typename D>
void dequant_row_blocks(const void* src, float* dst, int64_t n) {
    const typename D::Block* blocks = static_cast<const typename D::Block*>(src);
    for (int64_t ib = 0; ib < n / D::kBlockSize; ++ib) {
        StoreSink sink{dst + ib * D::kBlockSize};
        D::decode(blocks + ib, sink);
    }
}

template <typename D>
float dot_row_blocks(const void* src, const float* x, int64_t n) {
    static_assert(D::kBlockSize % (4 * kChunk) == 0, "every block must start on accumulator 0");
    const typename D::Block* blocks = static_cast<const typename D::Block*>(src);
    DotSink sink{x};
    for (int64_t ib = 0; ib < n / D::kBlockSize; ++ib) {
        prefetch_ahead(blocks + ib, sizeof(typename D::Block));
        sink.x = x + ib * D::kBlockSize;
        D::decode(blocks + ib, sink);
    }
    return reduce(sink.acc);
}

// ---- plain float rows (F32, F16, BF16): any n -------------------------------------------------------

// Lane mask with the first `count` (< 8) lanes set.
inline __m256i first_lanes(int64_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Copies `count` (< 8) 16-bit values into a zero-padded vector (no read past the row).
inline __m128i load_partial_u16(const uint16_t* p, int64_t count) {
    uint16_t buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    memcpy(buf, p, static_cast<size_t>(count) * 2);
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf));
}

struct LoadF32 {
    static constexpr size_t kBytes = 4;
    static const void* address(const void* p, int64_t i) { return static_cast<const float*>(p) + i; }
    static __m256 full(const void* p, int64_t i) { return _mm256_loadu_ps(static_cast<const float*>(p) + i); }
    static __m256 part(const void* p, int64_t i, int64_t count) {
        return _mm256_maskload_ps(static_cast<const float*>(p) + i, first_lanes(count));
    }
};
struct LoadF16 {
    static constexpr size_t kBytes = 2;
    static const void* address(const void* p, int64_t i) { return static_cast<const uint16_t*>(p) + i; }
    static __m256 full(const void* p, int64_t i) {
        return _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)));
    }
    static __m256 part(const void* p, int64_t i, int64_t count) {
        return _mm256_cvtph_ps(load_partial_u16(static_cast<const uint16_t*>(p) + i, count));
    }
};
struct LoadBF16 {
    static constexpr size_t kBytes = 2;
    static const void* address(const void* p, int64_t i) { return static_cast<const uint16_t*>(p) + i; }
    static __m256 widen(__m128i h) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    static __m256 full(const void* p, int64_t i) {
        return widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)));
    }
    static __m256 part(const void* p, int64_t i, int64_t count) {
        return widen(load_partial_u16(static_cast<const uint16_t*>(p) + i, count));
    }
};

// Main loop four chunks at a time, then whole chunks into accumulators 0, 1, 2 in order, then a
// partial chunk whose missing lanes keep their accumulator value (blend, not +0: -0 stays -0).
template <typename Load>
float dot_plain(const void* w, const float* x, int64_t n) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t i = 0;
    for (; i + 4 * kChunk <= n; i += 4 * kChunk) {
        prefetch_ahead(Load::address(w, i), 4 * kChunk * Load::kBytes);
        for (int k = 0; k < 4; ++k) {
            acc[k] =
                _mm256_fmadd_ps(Load::full(w, i + kChunk * k), _mm256_loadu_ps(x + i + kChunk * k), acc[k]);
        }
    }
    int k = 0;
    for (; i + kChunk <= n; i += kChunk, ++k) {
        acc[k] = _mm256_fmadd_ps(Load::full(w, i), _mm256_loadu_ps(x + i), acc[k]);
    }
    if (i < n) {
        const __m256i lanes = first_lanes(n - i);
        const __m256 sum = _mm256_fmadd_ps(Load::part(w, i, n - i), _mm256_maskload_ps(x + i, lanes), acc[k]);
        acc[k] = _mm256_blendv_ps(acc[k], sum, _mm256_castsi256_ps(lanes));
    }
    return reduce(acc);
}

template <typename Load>
void dequant_plain(const void* w, float* dst, int64_t n) {
    int64_t i = 0;
    for (; i + kChunk <= n; i += kChunk) _mm256_storeu_ps(dst + i, Load::full(w, i));
    if (i < n) _mm256_maskstore_ps(dst + i, first_lanes(n - i), Load::part(w, i, n - i));
}

float dot_f32_avx2(const float* a, const float* b, int64_t n) {
    return dot_plain<LoadF32>(a, b, n);
}

// One row x T tokens at once: each token has its own four accumulators fed exactly as dot_plain
// feeds them (same chunks, same order, same tail), so every result equals dot_f32's bit for bit,
// while each loaded chunk of w serves T tokens. T = 3 uses 12 accumulators of the 16 ymm registers.
template <int T>
void dot_f32_micro(const float* w, const float* x, int64_t ldx, int64_t n, float* y, int64_t ldy) {
    __m256 acc[T][4];
    for (int t = 0; t < T; ++t) {
        for (int k = 0; k < 4; ++k) acc[t][k] = _mm256_setzero_ps();
    }
    int64_t i = 0;
    for (; i + 4 * kChunk <= n; i += 4 * kChunk) {
        for (int k = 0; k < 4; ++k) {
            const __m256 wv = _mm256_loadu_ps(w + i + kChunk * k);
            for (int t = 0; t < T; ++t) {
                acc[t][k] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + t * ldx + i + kChunk * k), acc[t][k]);
            }
        }
    }
    // Tail as in dot_plain: whole chunks into accumulators 0, 1, 2, then a partial chunk.
    for (int k = 0; k < 4 && i < n; ++k) {
        if (n - i >= kChunk) {
            const __m256 wv = _mm256_loadu_ps(w + i);
            for (int t = 0; t < T; ++t)
                acc[t][k] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + t * ldx + i), acc[t][k]);
            i += kChunk;
        } else {
            const __m256i lanes = first_lanes(n - i);
            const __m256 wv = _mm256_maskload_ps(w + i, lanes);
            for (int t = 0; t < T; ++t) {
                const __m256 sum = _mm256_fmadd_ps(wv, _mm256_maskload_ps(x + t * ldx + i, lanes), acc[t][k]);
                acc[t][k] = _mm256_blendv_ps(acc[t][k], sum, _mm256_castsi256_ps(lanes));
            }
            i = n;
        }
    }
    for (int t = 0; t < T; ++t) y[t * ldy] = reduce(acc[t]);
}

void dot_f32_tile_avx2(const float* w, int64_t ldw, int64_t n_rows, const float* x, int64_t ldx,
                       int64_t n_tokens, int64_t n, float* y, int64_t ldy) {
    for (int64_t r = 0; r < n_rows; ++r) {
        const float* wr = w + r * ldw;
        int64_t t = 0;
        for (; t + 3 <= n_tokens; t += 3) dot_f32_micro<3>(wr, x + t * ldx, ldx, n, y + t * ldy + r, ldy);
        if (n_tokens - t == 2) dot_f32_micro<2>(wr, x + t * ldx, ldx, n, y + t * ldy + r, ldy);
        if (n_tokens - t == 1) dot_f32_micro<1>(wr, x + t * ldx, ldx, n, y + t * ldy + r, ldy);
    }
}

// ---- decoding helpers ---------------------------------------------------------------------------

inline float half_to_float(uint16_t h) {
    return _cvtsh_ss(h);
}

// 8 consecutive bytes widened to 8 dword lanes.
inline __m256i bytes_to_lanes(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i sbytes_to_lanes(const int8_t* p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 to_float(__m256i v) {
    return _mm256_cvtepi32_ps(v);
}

// Shift every dword left by s (right by -s when s < 0); s is a compile-time constant after inlining.
inline __m256i shift_left(__m256i v, int s) {
    if (s > 0) return _mm256_slli_epi32(v, s);
    if (s < 0) return _mm256_srli_epi32(v, -s);
    return v;
}

// ---- block decoders (chunk numbers count 8 elements from the block start) -----------------------

// Q4_0 / Q4_1: element i (i < 16) is the low nibble of qs[i], element 16 + i the high nibble.
struct DecodeQ4_0 {  // d * (q - 8)
    using Block = block_q4_0;
    static constexpr int kBlockSize = QK4_0;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink) {
        const __m256 d = _mm256_set1_ps(half_to_float(b->d));
        const __m256i low4 = _mm256_set1_epi32(0x0F), eight = _mm256_set1_epi32(8);
        for (int c = 0; c < 2; ++c) {
            const __m256i q = bytes_to_lanes(b->qs + 8 * c);
            sink.put(c, _mm256_mul_ps(d, to_float(_mm256_sub_epi32(_mm256_and_si256(q, low4), eight))));
            sink.put(2 + c, _mm256_mul_ps(d, to_float(_mm256_sub_epi32(_mm256_srli_epi32(q, 4), eight))));
        }
    }
};

struct DecodeQ4_1 {  // d * q + m
    using Block = block_q4_1;
    static constexpr int kBlockSize = QK4_1;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink) {
        const __m256 d = _mm256_set1_ps(half_to_float(b->d)), m = _mm256_set1_ps(half_to_float(b->m));
        const __m256i low4 = _mm256_set1_epi32(0x0F);
        for (int c = 0; c < 2; ++c) {
            const __m256i q = bytes_to_lanes(b->qs + 8 * c);
            sink.put(c, _mm256_add_ps(_mm256_mul_ps(d, to_float(_mm256_and_si256(q, low4))), m));
            sink.put(2 + c, _mm256_add_ps(_mm256_mul_ps(d, to_float(_mm256_srli_epi32(q, 4))), m));
        }
    }
};

// MXFP4: the nibbles index kMxfp4Values with vpshufb (int8 values), widened, times the scale.
struct DecodeMX4 {
    using Block = block_mxfp4;
    static constexpr int kBlockSize = QK_MXFP4;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink) {
        const __m256 d = _mm256_set1_ps(mxfp4_scale(b->e));
        const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(kMxfp4Values));
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->qs));
        const __m128i low4 = _mm_set1_epi8(0x0F);
        const __m128i v[2] = {_mm_shuffle_epi8(table, _mm_and_si128(q, low4)),
                              _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), low4))};
        for (int h = 0; h < 2; ++h) {
            sink.put(2 * h, _mm256_mul_ps(d, to_float(_mm256_cvtepi8_epi32(v[h]))));
            sink.put(2 * h + 1, _mm256_mul_ps(d, to_float(_mm256_cvtepi8_epi32(_mm_srli_si128(v[h], 8)))));
        }
    }
};

// Q5_0 / Q5_1: the fifth bit of element e is bit e of qh. Each half (16 elements) is broadcast
// pre-shifted left by 4, so a per-lane right shift by the element's offset lands its bit on bit 4.
// Calls value(q) on the 5-bit q of each chunk.
template <typename Sink, typename Value>
inline void decode_q5(const uint8_t* qs, const uint8_t* qh_bytes, Sink& sink, Value value) {
    uint32_t qh;
    memcpy(&qh, qh_bytes, 4);
    const __m256i low4 = _mm256_set1_epi32(0x0F), bit4 = _mm256_set1_epi32(0x10);
    const __m256i high_lo = _mm256_set1_epi32(static_cast<int>((qh & 0xFFFFu) << 4));
    const __m256i high_hi = _mm256_set1_epi32(static_cast<int>((qh >> 16) << 4));
    for (int c = 0; c < 2; ++c) {
        const __m256i offsets = _mm256_setr_epi32(8 * c, 8 * c + 1, 8 * c + 2, 8 * c + 3, 8 * c + 4,
                                                  8 * c + 5, 8 * c + 6, 8 * c + 7);
        const __m256i q = bytes_to_lanes(qs + 8 * c);
        const __m256i q_lo = _mm256_or_si256(_mm256_and_si256(q, low4),
                                             _mm256_and_si256(_mm256_srlv_epi32(high_lo, offsets), bit4));
        const __m256i q_hi = _mm256_or_si256(_mm256_srli_epi32(q, 4),
                                             _mm256_and_si256(_mm256_srlv_epi32(high_hi, offsets), bit4));
        sink.put(c, value(q_lo));
        sink.put(2 + c, value(q_hi));
    }
}

struct DecodeQ5_0 {  // d * (q - 16)
    using Block = block_q5_0;
    static constexpr int kBlockSize = QK5_0;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink) {
        const __m256 d = _mm256_set1_ps(half_to_float(b->d));
        const __m256i sixteen = _mm256_set1_epi32(16);
        decode_q5(b->qs, b->qh, sink,
                  [&](__m256i q) { return _mm256_mul_ps(d, to_float(_mm256_sub_epi32(q, sixteen))); });
    }
};

struct DecodeQ5_1 {  // d * q + m
    using Block = block_q5_1;
    static constexpr int kBlockSize = QK5_1;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink) {
        const __m256 d = _mm256_set1_ps(half_to_float(b->d)), m = _mm256_set1_ps(half_to_float(b->m));
        decode_q5(b->qs, b->qh, sink,
                  [&](__m256i q) { return _mm256_add_ps(_mm256_mul_ps(d, to_float(q)), m); });
    }
};

struct DecodeQ8_0 {  // float(q) * d
    using Block = block_q8_0;
    static constexpr int kBlockSize = QK8_0;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink) {
        const __m256 d = _mm256_set1_ps(half_to_float(b->d));
        for (int c = 0; c < 4; ++c) sink.put(c, _mm256_mul_ps(to_float(sbytes_to_lanes(b->qs + 8 * c)), d));
    }
};

// Q2_K: sub-block s = 8h + 2j + l covers chunks 2s, 2s + 1. T[k] = dl * (k & 3) - ml; the index is
// the qs byte shifted right by 2j, whose bit 2 (the next element's) selects the table's repeat.
struct DecodeQ2_K {
    using Block = block_q2_K;
    static constexpr int kBlockSize = QK_K;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink) {
        alignas(32) float dl[16], ml[16];
        const __m256 d = _mm256_set1_ps(half_to_float(b->d)), dmin = _mm256_set1_ps(half_to_float(b->dmin));
        for (int c = 0; c < 2; ++c) {
            const __m256i sc = bytes_to_lanes(b->scales + 8 * c);
            _mm256_store_ps(dl + 8 * c,
                            _mm256_mul_ps(d, to_float(_mm256_and_si256(sc, _mm256_set1_epi32(0x0F)))));
            _mm256_store_ps(ml + 8 * c, _mm256_mul_ps(dmin, to_float(_mm256_srli_epi32(sc, 4))));
        }
        keep_in_memory(dl);
        keep_in_memory(ml);
        const __m256 q_values = _mm256_setr_ps(0, 1, 2, 3, 0, 1, 2, 3);
        for (int h = 0; h < 2; ++h) {
            __m256i q[4];  // qs bytes 32h + 8c .. 32h + 8c + 7
            for (int c = 0; c < 4; ++c) q[c] = bytes_to_lanes(b->qs + 32 * h + 8 * c);
            for (int j = 0; j < 4; ++j) {
                for (int l = 0; l < 2; ++l) {
                    const int s = 8 * h + 2 * j + l;
                    const __m256 table =
                        _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(dl[s]), q_values), _mm256_set1_ps(ml[s]));
                    for (int c = 0; c < 2; ++c) {
                        sink.put(2 * s + c,
                                 _mm256_permutevar8x32_ps(table, shift_left(q[2 * l + c], -2 * j)));
                    }
                }
            }
        }
    }
};

// Q3_K: element 128h + 32j + i (i < 32) has table index (qs[32h + i] >> 2j) & 3 (bits 1:0) |
// hmask bit (4h + j) of hmask[i] (bit 2), built for 32 elements at once with byte operations (16-bit
// shifts; the masks drop bits that crossed a byte) and parked in a stack buffer; then
// T[k] = dl * (k - 4), since k = low + 4 * high and q = low - (high ? 0 : 4).
struct DecodeQ3_K {
    using Block = block_q3_K;
    static constexpr int kBlockSize = QK_K;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink) {
        alignas(32) float dl[16];
        alignas(32) uint8_t idx[32];
        uint32_t biased[4];
        unpack_q3_K_scales(b->scales, biased);
        const __m256 d = _mm256_set1_ps(half_to_float(b->d));
        for (int c = 0; c < 2; ++c) {
            const __m128i bytes =
                _mm_set_epi32(0, 0, static_cast<int>(biased[2 * c + 1]), static_cast<int>(biased[2 * c]));
            const __m256i scales = _mm256_sub_epi32(_mm256_cvtepu8_epi32(bytes), _mm256_set1_epi32(32));
            _mm256_store_ps(dl + 8 * c, _mm256_mul_ps(d, to_float(scales)));
        }
        keep_in_memory(dl);
        const __m256 q_values = _mm256_setr_ps(-4, -3, -2, -1, 0, 1, 2, 3);
        const __m256i low_bits = _mm256_set1_epi8(0x03), high_bit = _mm256_set1_epi8(0x04);
        const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->hmask));
        for (int h = 0; h < 2; ++h) {
            const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs + 32 * h));
            for (int j = 0; j < 4; ++j) {
                const int hbit = 4 * h + j;  // moved to bit 2
                const __m256i high =
                    hbit >= 2 ? _mm256_srli_epi16(hm, hbit - 2) : _mm256_slli_epi16(hm, 2 - hbit);
                const __m256i k = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * j), low_bits),
                                                  _mm256_and_si256(high, high_bit));
                _mm256_store_si256(reinterpret_cast<__m256i*>(idx), k);
                for (int l = 0; l < 2; ++l) {
                    const int s = 8 * h + 2 * j + l;
                    const __m256 table = _mm256_mul_ps(_mm256_set1_ps(dl[s]), q_values);
                    for (int c = 0; c < 2; ++c) {
                        sink.put(2 * s + c,
                                 _mm256_permutevar8x32_ps(table, bytes_to_lanes(idx + 16 * l + 8 * c)));
                    }
                }
            }
        }
    }
};

// Q4_K / Q5_K scales as floats: out[0..7] = d * sc[j], out[8..15] = dmin * m[j].
inline void q4_K_scales(const uint8_t* packed, uint16_t d_half, uint16_t dmin_half, float (&out)[16]) {
    const Q4KScaleWords w = unpack_q4_K_scale_min(packed);
    const __m256i sc =
        _mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, static_cast<int>(w.sc_hi), static_cast<int>(w.sc_lo)));
    const __m256i m =
        _mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, static_cast<int>(w.m_hi), static_cast<int>(w.m_lo)));
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_set1_ps(half_to_float(d_half)), to_float(sc)));
    _mm256_storeu_ps(out + 8, _mm256_mul_ps(_mm256_set1_ps(half_to_float(dmin_half)), to_float(m)));
    keep_in_memory(out);
}

// Q4_K: group j = sub-block 2j (low nibbles of qs[32j..32j+31], chunks 8j..8j+3) and 2j + 1 (high
// nibbles, chunks 8j+4..8j+7); value = (d * sc) * q - dmin * m.
struct DecodeQ4_K {
    using Block = block_q4_K;
    static constexpr int kBlockSize = QK_K;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink) {
        alignas(32) float scale_min[16];
        q4_K_scales(b->scales, b->d, b->dmin, scale_min);
        const __m256i low4 = _mm256_set1_epi32(0x0F);
        for (int j = 0; j < 4; ++j) {
            const __m256 d_lo = _mm256_set1_ps(scale_min[2 * j]), m_lo = _mm256_set1_ps(scale_min[8 + 2 * j]);
            const __m256 d_hi = _mm256_set1_ps(scale_min[2 * j + 1]),
                         m_hi = _mm256_set1_ps(scale_min[8 + 2 * j + 1]);
            for (int c = 0; c < 4; ++c) {
                const __m256i q = bytes_to_lanes(b->qs + 32 * j + 8 * c);
                sink.put(8 * j + c,
                         _mm256_sub_ps(_mm256_mul_ps(d_lo, to_float(_mm256_and_si256(q, low4))), m_lo));
                sink.put(8 * j + 4 + c,
                         _mm256_sub_ps(_mm256_mul_ps(d_hi, to_float(_mm256_srli_epi32(q, 4))), m_hi));
            }
        }
    }
};

// Q5_K: as Q4_K plus bit 4 from qh[i] at bit 2j (low nibbles) or 2j + 1 (high nibbles).
struct DecodeQ5_K {
    using Block = block_q5_K;
    static constexpr int kBlockSize = QK_K;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink) {
        alignas(32) float scale_min[16];
        q4_K_scales(b->scales, b->d, b->dmin, scale_min);
        const __m256i low4 = _mm256_set1_epi32(0x0F), bit4 = _mm256_set1_epi32(0x10);
        __m256i qh[4];
        for (int c = 0; c < 4; ++c) qh[c] = bytes_to_lanes(b->qh + 8 * c);
        for (int j = 0; j < 4; ++j) {
            const __m256 d_lo = _mm256_set1_ps(scale_min[2 * j]), m_lo = _mm256_set1_ps(scale_min[8 + 2 * j]);
            const __m256 d_hi = _mm256_set1_ps(scale_min[2 * j + 1]),
                         m_hi = _mm256_set1_ps(scale_min[8 + 2 * j + 1]);
            for (int c = 0; c < 4; ++c) {
                const __m256i q = bytes_to_lanes(b->qs + 32 * j + 8 * c);
                const __m256i q_lo = _mm256_or_si256(_mm256_and_si256(q, low4),
                                                     _mm256_and_si256(shift_left(qh[c], 4 - 2 * j), bit4));
                const __m256i q_hi = _mm256_or_si256(_mm256_srli_epi32(q, 4),
                                                     _mm256_and_si256(shift_left(qh[c], 3 - 2 * j), bit4));
                sink.put(8 * j + c, _mm256_sub_ps(_mm256_mul_ps(d_lo, to_float(q_lo)), m_lo));
                sink.put(8 * j + 4 + c, _mm256_sub_ps(_mm256_mul_ps(d_hi, to_float(q_hi)), m_hi));
            }
        }
    }
};

// Q6_K: q - 32 assembled 32 elements at a time with byte operations (bit layout in the scalar
// reference), parked in a stack buffer and widened 8 at a time; value = (d * scales[e / 16]) * (q - 32).
struct DecodeQ6_K {
    using Block = block_q6_K;
    static constexpr int kBlockSize = QK_K;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink) {
        alignas(32) float dsc[16];
        alignas(32) int8_t q[128];
        const __m256 d = _mm256_set1_ps(half_to_float(b->d));
        for (int c = 0; c < 2; ++c)
            _mm256_store_ps(dsc + 8 * c, _mm256_mul_ps(d, to_float(sbytes_to_lanes(b->scales + 8 * c))));
        keep_in_memory(dsc);
        const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30),
                      bias = _mm256_set1_epi8(32);
        for (int h = 0; h < 2; ++h) {
            const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->ql + 64 * h));
            const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->ql + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qh + 32 * h));
            // k = 0..3: low 4 bits from ql0 / ql1 low nibbles, then ql0 / ql1 high nibbles; high
            // 2 bits from qh at bit 2k, moved to bits 4-5 (16-bit shifts; the 0x30 mask drops the
            // bits that crossed a byte boundary).
            const __m256i parts[4] = {
                _mm256_or_si256(_mm256_and_si256(ql0, low4),
                                _mm256_and_si256(_mm256_slli_epi16(qh, 4), bits45)),
                _mm256_or_si256(_mm256_and_si256(ql1, low4),
                                _mm256_and_si256(_mm256_slli_epi16(qh, 2), bits45)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                                _mm256_and_si256(qh, bits45)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                                _mm256_and_si256(_mm256_srli_epi16(qh, 2), bits45)),
            };
            for (int k = 0; k < 4; ++k) {
                _mm256_store_si256(reinterpret_cast<__m256i*>(q + 32 * k), _mm256_sub_epi8(parts[k], bias));
            }
            for (int c = 0; c < 16; ++c) {
                const int chunk = 16 * h + c;  // elements 8 * chunk .. + 7, sub-block chunk / 2
                sink.put(chunk,
                         _mm256_mul_ps(_mm256_set1_ps(dsc[chunk / 2]), to_float(sbytes_to_lanes(q + 8 * c))));
            }
        }
    }
};

// ---- IQ types (iq_unpack.h): values (d * sc) * q, every product exact --------------------------

// 32 int8 values -> chunks c0 .. c0 + 3 scaled by `scale`.
template <typename Sink>
inline void put_scaled32(__m256i q, float scale, int c0, Sink& sink) {
    const __m256 s = _mm256_set1_ps(scale);
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    sink.put(c0, _mm256_mul_ps(s, to_float(_mm256_cvtepi8_epi32(lo))));
    sink.put(c0 + 1, _mm256_mul_ps(s, to_float(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)))));
    sink.put(c0 + 2, _mm256_mul_ps(s, to_float(_mm256_cvtepi8_epi32(hi))));
    sink.put(c0 + 3, _mm256_mul_ps(s, to_float(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)))));
}

struct DecodeIQ4_NL {  // d * kIq4nlValues[q], the values by pshufb
    using Block = block_iq4_nl;
    static constexpr int kBlockSize = QK4_NL;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink) {
        put_scaled32(iq4_values32_avx2(b->qs), half_to_float(b->d), 0, sink);
    }
};

struct DecodeIQ4_XS {  // (d * (ls - 32)) * kIq4nlValues[q]
    using Block = block_iq4_xs;
    static constexpr int kBlockSize = QK_K;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink) {
        const float d = half_to_float(b->d);
        for (int ib = 0; ib < QK_K / 32; ++ib) {
            put_scaled32(iq4_values32_avx2(b->qs + 16 * ib), d * static_cast<float>(iq4_xs_scale(b, ib)),
                         4 * ib, sink);
        }
    }
};

// The lattice types: grid lookups into an IqUnpacked, then 8 floats per chunk.
template <typename B, void (*Unpack)(const B*, IqUnpacked&)>
struct DecodeIqGrid {
    using Block = B;
    static constexpr int kBlockSize = QK_K;
    template <typename Sink>
    static void decode(const Block* b, Sink& sink) {
        alignas(32) IqUnpacked u;
        Unpack(b, u);
        for (int c = 0; c < QK_K / 8; ++c) {
            const __m256 scale = _mm256_set1_ps(u.d * static_cast<float>(u.sc[c / 2]));
            sink.put(c, _mm256_mul_ps(scale, to_float(sbytes_to_lanes(u.q + 8 * c))));
        }
    }
};

SHARPI_SIMD_KERNEL_TABLE(kAvx2Kernels, dot_f32_avx2, dot_f32_tile_avx2)

}  // namespace

const IsaKernels& avx2_kernels() {
    return kAvx2Kernels;
}

}  // namespace sharpi::cpu::detail
