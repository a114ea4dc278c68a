// The fast-mode kernels of qdot.h on 256-bit vectors, shared by qdot_avx2.cpp and
// qdot_avx512vnni.cpp: each includes this file INSIDE its anonymous namespace (internal linkage,
// see kernels_impl.h on the ODR hazard) after defining its two integer primitives:
//   acc_scaled_pairs(acc, u, x, s16): acc + sum over pairs (u[2i] x[2i] + u[2i+1] x[2i+1]) * s16[i],
//     u unsigned bytes, x signed bytes, s16 int16 (AVX2: maddubs + madd + add; VNNI: maddubs + dpwssd)
//   dot_quads(u, x): int32 lanes l = sum_{i=4l..4l+3} u[i] x[i] (AVX2: maddubs + madd; VNNI: dpbusd)
// Every product sum fits its lanes (|u| <= 63 or 128, |x| <= 127: no saturation; signed IQ quants
// enter as |q| <= 127, so a maddubs pair is at most 2 * 127 * 127 < 2^15), so the integer
// results are exact, and the float operations follow qdot.h one rounding at a time (separate
// multiply and add intrinsics, and -ffp-contract=off for the plain float expressions: no FMA), so
// this code gives the scalar reference's bits. Weight blocks are unpacked once per tile of tokens,
// and the k_dot_tokens / b32_dot_tokens loops for one token are the same code as for a tile.
//
// Not a normal header: no include guard, no namespace of its own.

inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

// ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))
inline float tree8(__m256 a) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    const __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
    return _mm_cvtss_f32(s1);
}

// One f32 rounding (an intrinsic, so the compiler cannot fuse it with a neighbour).
inline float mul_f(float a, float b) {
    return _mm_cvtss_f32(_mm_mul_ss(_mm_set_ss(a), _mm_set_ss(b)));
}

// f(std::integral_constant<int, n>()) for a run-time tile size n in [1, N] (n < 1 takes 1, n > N
// takes N): one template instance per size, chosen once per call.
template <int N, typename F>
inline void with_tile_size(int n, F&& f) {
    if constexpr (N > 1) {
        if (n < N) return with_tile_size<N - 1>(n, f);
    }
    f(std::integral_constant<int, N>());
}

// f(std::integral_constant<int, i>()) for i = 0 .. N - 1 in order (a loop whose index is a
// compile-time constant in the body, for templates such as a decoder's chunk<C>).
template <typename F, int... I>
inline void unrolled(F&& f, std::integer_sequence<int, I...>) {
    (f(std::integral_constant<int, I>()), ...);
}
template <int N, typename F>
inline void unrolled(F&& f) {
    unrolled(f, std::make_integer_sequence<int, N>());
}

inline uint32_t load_u32_any(const void* p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

inline long long load_i64_any(const void* p) {
    long long v;
    memcpy(&v, p, 8);
    return v;
}

inline __m256i load256(const void* p) {
    return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

// Bit `from` of every byte moved to bit `to`, other bits cleared. Shifts act on 16-bit lanes; the
// bits that cross from the neighbouring byte never land on bit `to` (see the mask argument in
// kernels_impl.h), so the result is per byte.
template <int from, int to>
inline __m256i move_bit(__m256i v) {
    const __m256i mask = _mm256_set1_epi8(static_cast<char>(1 << to));
    if constexpr (to > from) return _mm256_and_si256(_mm256_slli_epi16(v, to - from), mask);
    if constexpr (to < from) return _mm256_and_si256(_mm256_srli_epi16(v, from - to), mask);
    return _mm256_and_si256(v, mask);
}

// An empty asm that makes v a register operand: the compiler must have v's value at this point,
// so it cannot reassociate a chain of integer adds across it. Without it GCC 12 at -O3 turned the
// 8-token tile's eight accumulator chains into one tree of adds per block, keeping every product
// of the block live and spilling them (64 stores and reloads per block: the tile ran 10-17%
// slower). No instruction is emitted; the value is unchanged.
inline void keep_in_register(__m256i& v) {
    __asm__("" : "+x"(v));
}

// (v >> shift) & mask per byte (mask must clear the bits shifted in from the neighbouring byte).
inline __m256i byte_field(__m256i v, int shift, int mask) {
    return _mm256_and_si256(_mm256_srli_epi16(v, shift), _mm256_set1_epi8(static_cast<char>(mask)));
}

// ---- activation quantizers (qdot.h): blocks of 32 values, 4 vectors each --------------------------

struct Q8Block32 {
    float d;
    int32_t sum;  // sum of the 32 quants
};

// Quantizes x[0..32 * n_sub) with one scale (n_sub 32-value groups: 1 for q8_0 / q8_1, 8 for q8_K);
// also writes the sum of each 16 quants to sums16 when not null.
inline float quantize_group(const float* x, int n_sub, int8_t* q, int16_t* sums16, int32_t* total) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 32 * n_sub; i += 8)
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float max_abs = _mm_cvtss_f32(m4);
    const float d = _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(max_abs), _mm_set_ss(127.0f)));
    const float id =
        max_abs != 0.0f ? _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(127.0f), _mm_set_ss(max_abs))) : 0.0f;
    const __m256 vid = _mm256_set1_ps(id);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int32_t all = 0;
    for (int g = 0; g < n_sub; ++g) {
        __m256i v[4];
        for (int k = 0; k < 4; ++k) {
            const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(x + 32 * g + 8 * k), vid);
            v[k] = _mm256_cvtps_epi32(_mm256_round_ps(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
        if (sums16 != nullptr) {
            sums16[2 * g] = static_cast<int16_t>(hsum_epi32(_mm256_add_epi32(v[0], v[1])));
            sums16[2 * g + 1] = static_cast<int16_t>(hsum_epi32(_mm256_add_epi32(v[2], v[3])));
        }
        if (total != nullptr)
            all += hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3])));
        // packs interleave the 128-bit halves; the permutation restores element order.
        const __m256i w16a = _mm256_packs_epi32(v[0], v[1]), w16b = _mm256_packs_epi32(v[2], v[3]);
        const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16a, w16b), order);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * g), b);
    }
    if (total != nullptr) *total = all;
    return d;
}

inline float half_to_float(uint16_t h) {
    return _cvtsh_ss(h);  // F16C: exact, as fp16_to_fp32 (a NaN comes back quiet)
}

inline uint16_t float_to_half(float f) {
    return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}

void quantize_q8_0(const float* x, void* dst, int64_t n) {
    block_q8_0* y = static_cast<block_q8_0*>(dst);
    for (int64_t ib = 0; ib < n / QK8_0; ++ib) {
        y[ib].d = float_to_half(quantize_group(x + ib * QK8_0, 1, y[ib].qs, nullptr, nullptr));
    }
}

void quantize_q8_1(const float* x, void* dst, int64_t n) {
    block_q8_1* y = static_cast<block_q8_1*>(dst);
    for (int64_t ib = 0; ib < n / QK8_0; ++ib) {
        int32_t sum = 0;
        const float d = quantize_group(x + ib * QK8_0, 1, y[ib].qs, nullptr, &sum);
        y[ib].d = float_to_half(d);
        y[ib].s = float_to_half(mul_f(static_cast<float>(sum), d));
    }
}

void quantize_q8_K(const float* x, void* dst, int64_t n) {
    block_q8_K* y = static_cast<block_q8_K*>(dst);
    for (int64_t ib = 0; ib < n / QK_K; ++ib) {
        y[ib].d = quantize_group(x + ib * QK_K, QK_K / 32, y[ib].qs, y[ib].bsums, nullptr);
    }
}

// ---- K-quants ------------------------------------------------------------------------------------

// A K-quant block unpacked: u[c] = unsigned quants of elements 32c .. 32c + 31; sc / mn = the 16
// sub-block scales (signed) and mins as bytes; w = d * sc * (u - kOffset) - dmin * mn.
struct KUnpacked {
    __m256i u[8];
    __m128i sc;
    __m128i mn;
    __m128 d_dmin;  // [d, dmin, -, -] (dmin lane unused by types without mins)
};

// f16 d (and dmin right after it, when `with_min`) as floats.
inline __m128 load_d_dmin(const uint16_t* d, bool with_min) {
    return _mm_cvtph_ps(with_min ? _mm_cvtsi32_si128(static_cast<int>(load_u32_any(d)))
                                 : _mm_cvtsi32_si128(*d));
}

// Q4_K / Q5_K: the 8 six-bit scales and mins (kernels_impl.h's unpack_q4_K_scale_min, in SIMD),
// each repeated for the two 16-element halves of its sub-block. Reads 16 bytes at `packed` (the 12
// scale bytes and the first 4 quant bytes of the block).
inline void q4_K_scales16(const uint8_t* packed, __m128i& sc, __m128i& mn) {
    const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
    // Low parts: sc[0..3] = s[0..3] & 63, sc[4..7] = s[8..11] & 15, m[0..3] = s[4..7] & 63,
    // m[4..7] = s[8..11] >> 4; high parts of sc[4..7] / m[4..7]: bits 6-7 of s[0..3] / s[4..7].
    const __m128i low =
        _mm_srlv_epi32(_mm_shuffle_epi8(s, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11)),
                       _mm_setr_epi32(0, 0, 0, 4));
    const __m128i low_mask = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15);
    const __m128i top =
        _mm_shuffle_epi8(s, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i r =
        _mm_or_si128(_mm_and_si128(low, low_mask),
                     _mm_and_si128(_mm_srli_epi16(top, 2), _mm_set1_epi8(0x30)));  // [sc0..7, m0..7]
    sc = _mm_unpacklo_epi8(r, r);
    mn = _mm_unpackhi_epi8(r, r);
}

// The K decoders below that define kChunkDecode unpack a block in two parts: header() gives d,
// dmin and the scales (KUnpacked's u left unset), chunk<C>() gives u[C] alone, so a row loop can
// unpack each chunk right where it multiplies it instead of keeping all eight live (decode() is
// header() plus the eight chunks: the same values either way).
struct KQ4_K {
    using Block = block_q4_K;
    static constexpr int kOffsetShift = -1;  // no offset
    static constexpr bool kHasMin = true;
    static constexpr bool kSigned = false;  // u unsigned
    static constexpr bool kChunkDecode = true;
    static void header(const Block* b, KUnpacked& k) {
        k.d_dmin = load_d_dmin(&b->d, true);
        q4_K_scales16(b->scales, k.sc, k.mn);
    }
    // Chunks 2j and 2j + 1: the low and high nibbles of qs[32j .. 32j + 31].
    template <int C>
    static __m256i chunk(const Block* b) {
        const __m256i q = load256(b->qs + 32 * (C / 2));
        return C % 2 == 0 ? _mm256_and_si256(q, _mm256_set1_epi8(0x0F)) : byte_field(q, 4, 0x0F);
    }
    static void decode(const Block* b, KUnpacked& k) {
        header(b, k);
        unrolled<8>([&](auto c) { k.u[c] = chunk<c>(b); });
    }
};

struct KQ5_K {
    using Block = block_q5_K;
    static constexpr int kOffsetShift = -1;
    static constexpr bool kHasMin = true;
    static constexpr bool kSigned = false;  // u unsigned
    static constexpr bool kChunkDecode = true;
    static void header(const Block* b, KUnpacked& k) {
        k.d_dmin = load_d_dmin(&b->d, true);
        q4_K_scales16(b->scales, k.sc, k.mn);
    }
    // Chunk C: Q4_K's nibble, plus bit C of qh[i] as bit 4.
    template <int C>
    static __m256i chunk(const Block* b) {
        const __m256i q = load256(b->qs + 32 * (C / 2));
        const __m256i low = C % 2 == 0 ? _mm256_and_si256(q, _mm256_set1_epi8(0x0F)) : byte_field(q, 4, 0x0F);
        return _mm256_or_si256(low, move_bit<C, 4>(load256(b->qh)));
    }
    static void decode(const Block* b, KUnpacked& k) {
        header(b, k);
        unrolled<8>([&](auto c) { k.u[c] = chunk<c>(b); });
    }
};

// Q6_K: chunk 4h + c: low 4 bits from ql[64h + 32(c % 2) + i] (low nibble for c < 2, else high),
// high 2 bits from qh[32h + i] at bit 2c.
struct KQ6_K {
    using Block = block_q6_K;
    static constexpr int kOffsetShift = 5;  // offset 32
    static constexpr bool kHasMin = false;
    static constexpr bool kSigned = false;  // u unsigned
    static constexpr bool kChunkDecode = true;
    static void header(const Block* b, KUnpacked& k) {
        k.d_dmin = load_d_dmin(&b->d, false);
        k.sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales));
        k.mn = _mm_setzero_si128();
    }
    template <int C>
    static __m256i chunk(const Block* b) {
        constexpr int h = C / 4, c = C % 4;
        const __m256i l = load256(b->ql + 64 * h + 32 * (c % 2));
        const __m256i qh = load256(b->qh + 32 * h);
        const __m256i low = c < 2 ? _mm256_and_si256(l, _mm256_set1_epi8(0x0F)) : byte_field(l, 4, 0x0F);
        const __m256i bits45 = _mm256_set1_epi8(0x30);
        __m256i high;
        if constexpr (c == 0) high = _mm256_and_si256(_mm256_slli_epi16(qh, 4), bits45);
        if constexpr (c == 1) high = _mm256_and_si256(_mm256_slli_epi16(qh, 2), bits45);
        if constexpr (c == 2) high = _mm256_and_si256(qh, bits45);
        if constexpr (c == 3) high = byte_field(qh, 2, 0x30);
        return _mm256_or_si256(low, high);
    }
    static void decode(const Block* b, KUnpacked& k) {
        header(b, k);
        unrolled<8>([&](auto c) { k.u[c] = chunk<c>(b); });
    }
};

// Q3_K: chunk 4h + j: low 2 bits of qs[32h + i] at bit 2j, high bit of hmask[i] at bit 4h + j;
// u = low + 4 * high, w = d * sc * (u - 4).
struct KQ3_K {
    using Block = block_q3_K;
    static constexpr int kOffsetShift = 2;  // offset 4
    static constexpr bool kHasMin = false;
    static constexpr bool kSigned = false;  // u unsigned
    static void decode(const Block* b, KUnpacked& k) {
        k.d_dmin = load_d_dmin(&b->d, false);
        uint32_t biased[4];
        unpack_q3_K_scales(b->scales, biased);
        k.sc = _mm_sub_epi8(_mm_set_epi32(static_cast<int>(biased[3]), static_cast<int>(biased[2]),
                                          static_cast<int>(biased[1]), static_cast<int>(biased[0])),
                            _mm_set1_epi8(32));
        k.mn = _mm_setzero_si128();
        const __m256i hm = load256(b->hmask);
        const __m256i q0 = load256(b->qs), q1 = load256(b->qs + 32);
        k.u[0] = _mm256_or_si256(byte_field(q0, 0, 3), move_bit<0, 2>(hm));
        k.u[1] = _mm256_or_si256(byte_field(q0, 2, 3), move_bit<1, 2>(hm));
        k.u[2] = _mm256_or_si256(byte_field(q0, 4, 3), move_bit<2, 2>(hm));
        k.u[3] = _mm256_or_si256(byte_field(q0, 6, 3), move_bit<3, 2>(hm));
        k.u[4] = _mm256_or_si256(byte_field(q1, 0, 3), move_bit<4, 2>(hm));
        k.u[5] = _mm256_or_si256(byte_field(q1, 2, 3), move_bit<5, 2>(hm));
        k.u[6] = _mm256_or_si256(byte_field(q1, 4, 3), move_bit<6, 2>(hm));
        k.u[7] = _mm256_or_si256(byte_field(q1, 6, 3), move_bit<7, 2>(hm));
    }
};

// Q2_K: chunk 4h + j: 2 bits of qs[32h + i] at bit 2j; scales low nibble, mins high nibble.
struct KQ2_K {
    using Block = block_q2_K;
    static constexpr int kOffsetShift = -1;
    static constexpr bool kHasMin = true;
    static constexpr bool kSigned = false;  // u unsigned
    static void decode(const Block* b, KUnpacked& k) {
        k.d_dmin = load_d_dmin(&b->d, true);
        const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales));
        k.sc = _mm_and_si128(s, _mm_set1_epi8(0x0F));
        k.mn = _mm_and_si128(_mm_srli_epi16(s, 4), _mm_set1_epi8(0x0F));
        const __m256i q0 = load256(b->qs), q1 = load256(b->qs + 32);
        for (int j = 0; j < 4; ++j) {
            k.u[j] = byte_field(q0, 2 * j, 3);
            k.u[4 + j] = byte_field(q1, 2 * j, 3);
        }
    }
};

// The 256-element IQ types without a chunk decoder below (IQ3_S, IQ2_S, IQ2_XS, IQ1_S, IQ1_M):
// signed quants q (iq_unpack.h; kSigned: the row loops take |q| as the unsigned operand and move
// q's sign onto the activations), no offset, no min, unpacked through an IqUnpacked.
template <typename B, void (*Unpack)(const B*, IqUnpacked&)>
struct KIq {
    using Block = B;
    static constexpr int kOffsetShift = -1;
    static constexpr bool kHasMin = false;
    static constexpr bool kSigned = true;
    static void decode(const Block* b, KUnpacked& k) {
        alignas(32) IqUnpacked iq;
        Unpack(b, iq);
        k.d_dmin = _mm_set_ss(iq.d);
        for (int c = 0; c < 8; ++c) k.u[c] = load256(iq.q + 32 * c);
        k.sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(iq.sc));
        k.mn = _mm_setzero_si128();
    }
};

template <typename D, typename = void>
struct HasChunkDecode : std::false_type {};
template <typename D>
struct HasChunkDecode<D, std::void_t<decltype(D::kChunkDecode)>> : std::true_type {};

// acc_scaled_pairs for decoder D's quants: signed ones as |q| times the activations signed by q.
template <typename D>
inline __m256i k_scaled_pairs(__m256i acc, __m256i u, __m256i x, __m256i s16) {
    if constexpr (D::kSigned)
        return acc_scaled_pairs(acc, _mm256_sign_epi8(u, u), _mm256_sign_epi8(x, u), s16);
    return acc_scaled_pairs(acc, u, x, s16);
}

// The 16 sub-block scales as int16, even ones in the low 128-bit half, odd ones in the high half,
// so that one in-lane shuffle per chunk (chunk_scales) picks both of a chunk's scales.
inline __m256i split_scales(__m128i sc) {
    const __m128i even_odd = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, even_odd));
}

// Scales of chunk c as int16 lanes: lanes 0-7 (elements 32c .. 32c + 15) sc[2c], lanes 8-15 sc[2c + 1].
inline __m256i chunk_scales(__m256i split, int c) {
    const __m256i pick = _mm256_set1_epi16(static_cast<short>(0x0100 * (2 * c + 1) + 2 * c));
    return _mm256_shuffle_epi8(split, pick);
}

// One block of one token in integers: `pairs` holds, per 128-bit half, [pair sums of the block's
// sum_s sc[s] * (sum u q) lanes (the offset term taken off), pair sums of its min products] for
// the types with mins, else the eight lanes themselves; all exact (qdot.h).
struct KBlockInts {
    __m256i pairs;
    __m128 d_dmin;
};

template <typename D>
inline KBlockInts k_block_ints(const typename D::Block* b, const block_q8_K& xb) {
    KUnpacked k;
    D::decode(b, k);
    const __m256i split = split_scales(k.sc);
    __m256i v = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c)
        v = k_scaled_pairs<D>(v, k.u[c], load256(xb.qs + 32 * c), chunk_scales(split, c));
    const __m256i bsums = load256(xb.bsums);
    if constexpr (D::kOffsetShift >= 0) {
        v = _mm256_sub_epi32(
            v, _mm256_slli_epi32(_mm256_madd_epi16(_mm256_cvtepi8_epi16(k.sc), bsums), D::kOffsetShift));
    }
    if constexpr (D::kHasMin) v = _mm256_hadd_epi32(v, _mm256_madd_epi16(_mm256_cvtepu8_epi16(k.mn), bsums));
    return {v, k.d_dmin};
}

// acc after one block: the reductions of k_block_ints' pairs, then the f32 operations in qdot.h's
// order, acc + (dx * d) * float(isum), then - (dx * dmin) * float(imin) for the types with mins.
template <typename D>
inline float k_block_finish(float acc, const KBlockInts& block, float dx) {
    __m128i sums;  // [isum, imin, ...]
    if constexpr (D::kHasMin) {
        const __m128i q =
            _mm_add_epi32(_mm256_castsi256_si128(block.pairs), _mm256_extracti128_si256(block.pairs, 1));
        sums = _mm_hadd_epi32(q, q);
    } else {
        sums = _mm_cvtsi32_si128(hsum_epi32(block.pairs));
    }
    const __m128 terms = _mm_mul_ps(_mm_mul_ps(_mm_set1_ps(dx), block.d_dmin), _mm_cvtepi32_ps(sums));
    acc = acc + _mm_cvtss_f32(terms);
    if constexpr (D::kHasMin) acc = acc - _mm_cvtss_f32(_mm_movehdup_ps(terms));
    return acc;
}

// The K-quant row loop for one token, software-pipelined: each step computes block ib's integers
// and only then finishes block ib - 1 (its reductions and float steps), so the instructions that
// wait on a block's long chain (decode, products, reductions, int -> float, two multiplies, the
// add) come a whole block after the ones that start it. In block order, the vector scheduler's
// window (about one block of instructions) filled with the finishing block's waiting operations.
template <typename D>
inline float k_dot_one_token(const typename D::Block* blocks, const block_q8_K* x, int64_t n_blocks) {
    float acc = 0.0f;
    if (n_blocks <= 0) return acc;
    KBlockInts previous = k_block_ints<D>(blocks, x[0]);
    for (int64_t ib = 1; ib < n_blocks; ++ib) {
        prefetch_ahead(blocks + ib, sizeof(typename D::Block));
        const KBlockInts current = k_block_ints<D>(blocks + ib, x[ib]);
        acc = k_block_finish<D>(acc, previous, x[ib - 1].d);
        previous = current;
    }
    return k_block_finish<D>(acc, previous, x[n_blocks - 1].d);
}

// Eight int32 vectors -> one vector of their eight horizontal sums (lane t = sum of v[t]'s lanes).
inline __m256i hsum8_epi32(const __m256i* v) {
    const __m256i a0 = _mm256_hadd_epi32(v[0], v[1]), a1 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i a2 = _mm256_hadd_epi32(v[4], v[5]), a3 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i b0 = _mm256_hadd_epi32(a0, a1), b1 = _mm256_hadd_epi32(a2, a3);
    return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20), _mm256_permute2x128_si256(b0, b1, 0x31));
}

// The K-quant row loop for a tile of NT tokens (2..8) with the per-block epilogue of k_block_finish
// done for all the tokens at once: the integer sums of the NT tokens transposed into one vector
// (hsum8_epi32), then qdot.h's float operations lane by lane, lane t being token t:
//   acc[t] = acc[t] + (dx[t] * d) * float(isum[t]);  acc[t] = acc[t] - (dx[t] * dmin) * float(imin[t])
// one rounding each, as in k_block_finish (IEEE multiplication commutes), so every token gets
// k_dot_one_token's bits while the horizontal reductions and scalar float steps per (block, token)
// become a handful of vector operations per block.
template <typename D, int NT>
inline void k_dot_tokens_256_wide(const void* w, const void* xq, size_t xq_stride, int64_t n, float* acc) {
    static_assert(NT >= 2 && NT <= 8, "a tile of 2 to 8 tokens");
    const typename D::Block* blocks = static_cast<const typename D::Block*>(w);
    const block_q8_K* x[NT];
    for (int t = 0; t < NT; ++t)
        x[t] = reinterpret_cast<const block_q8_K*>(static_cast<const uint8_t*>(xq) + t * xq_stride);
    __m256 accv = _mm256_setzero_ps();
    for (int64_t ib = 0; ib < n / QK_K; ++ib) {
        prefetch_ahead(blocks + ib, sizeof(typename D::Block));
        KUnpacked k;
        __m256i v[8], mv[8];
        float dx[8];
        for (int t = 0; t < 8; ++t) {
            v[t] = _mm256_setzero_si256();
            mv[t] = _mm256_setzero_si256();
            dx[t] = 0.0f;
        }
        // Chunks outer, tokens inner: a chunk's quants and scales stay in two registers while the
        // NT accumulators take its products, so the loop loads only activations. (Tokens outer
        // kept all 8 chunks' quants and scales live and spilled them: two extra loads per
        // product on AVX2's 16 registers.) A decoder with kChunkDecode also unpacks each chunk's
        // quants and scales right before its products: unpacking all eight first kept 16 more
        // vectors live beside the 8 accumulators, and the spills cost a third of the loop. The
        // lanes are exact int32 sums, so the order is free.
        if constexpr (HasChunkDecode<D>::value) {
            D::header(blocks + ib, k);
            const __m256i split = split_scales(k.sc);
            unrolled<8>([&](auto c) {
                const __m256i u = D::template chunk<c>(blocks + ib);
                const __m256i s = chunk_scales(split, c);
                for (int t = 0; t < NT; ++t) {
                    v[t] = k_scaled_pairs<D>(v[t], u, load256(x[t][ib].qs + 32 * c), s);
                    keep_in_register(v[t]);
                }
            });
        } else {
            D::decode(blocks + ib, k);
            __m256i s[8];
            const __m256i split = split_scales(k.sc);
            for (int c = 0; c < 8; ++c) s[c] = chunk_scales(split, c);
            for (int c = 0; c < 8; ++c) {
                for (int t = 0; t < NT; ++t) {
                    v[t] = k_scaled_pairs<D>(v[t], k.u[c], load256(x[t][ib].qs + 32 * c), s[c]);
                    keep_in_register(v[t]);
                }
            }
        }
        const __m256i sc16 = _mm256_cvtepi8_epi16(k.sc);
        const __m256i mn16 = _mm256_cvtepu8_epi16(k.mn);
        for (int t = 0; t < NT; ++t) {
            const block_q8_K& xb = x[t][ib];
            const __m256i bsums = load256(xb.bsums);
            if constexpr (D::kOffsetShift >= 0) {
                v[t] = _mm256_sub_epi32(v[t],
                                        _mm256_slli_epi32(_mm256_madd_epi16(sc16, bsums), D::kOffsetShift));
            }
            if constexpr (D::kHasMin) mv[t] = _mm256_madd_epi16(mn16, bsums);
            dx[t] = xb.d;
        }
        const __m256 dxv = _mm256_setr_ps(dx[0], dx[1], dx[2], dx[3], dx[4], dx[5], dx[6], dx[7]);
        const __m256 d = _mm256_set1_ps(_mm_cvtss_f32(k.d_dmin));
        accv = _mm256_add_ps(accv, _mm256_mul_ps(_mm256_mul_ps(dxv, d), _mm256_cvtepi32_ps(hsum8_epi32(v))));
        if constexpr (D::kHasMin) {
            const __m256 dmin = _mm256_set1_ps(_mm_cvtss_f32(_mm_movehdup_ps(k.d_dmin)));
            accv = _mm256_sub_ps(
                accv, _mm256_mul_ps(_mm256_mul_ps(dxv, dmin), _mm256_cvtepi32_ps(hsum8_epi32(mv))));
        }
    }
    float all[8];
    _mm256_storeu_ps(all, accv);
    for (int t = 0; t < NT; ++t) acc[t] = all[t];
}

// The K-quant row loop: one token through k_dot_one_token, a tile through k_dot_tokens_256_wide
// (the same bits per token). K-quants stay on 256-bit vectors on AVX-512 too: a 512-bit version
// (two chunks per instruction, variable-shift decoders) measured 15-20% slower on an AMD EPYC
// (Zen 4 splits 512-bit operations in two), so it was dropped.
template <typename D, int NT>
void k_dot_tokens(const void* w, const void* xq, size_t xq_stride, int64_t n, float* acc) {
    if constexpr (NT >= 2) {
        k_dot_tokens_256_wide<D, NT>(w, xq, xq_stride, n, acc);
    } else {
        acc[0] = k_dot_one_token<D>(static_cast<const typename D::Block*>(w),
                                    static_cast<const block_q8_K*>(xq), n / QK_K);
    }
}

// ---- IQ types decoded chunk by chunk -------------------------------------------------------------
//
// IQ4_XS, IQ3_XXS and IQ2_XXS skip KUnpacked: their decoders hand each chunk of 32 quants straight
// to the row loop (iq_dot_tokens) as three vectors, so nothing is stored and reloaded, and the signs
// never touch the weights:
//   u    the magnitudes |q| (unsigned bytes: the grids are positive, IQ4_XS takes |value|),
//   sign a byte per element, negative exactly where q < 0 and never zero (vpsignb's operand),
//   s16  the chunk's scale as int16 lanes (these three types have one scale per 32 elements).
// The activation x is signed by `sign` (vpsignb) and dotted with u, so each chunk adds
// sc * sum |q_i| * (sign_i x_i) = sc * sum q_i x_i: the same exact int32 isum as the KUnpacked path
// and the scalar reference, and the same float steps per block (qdot.h), hence the same bits.
// (The IQ4_XS values, IQ3_XXS and IQ2_XXS grids have no zero, so sign bytes never zero an x.)
// A decoder D has kChunks, scale(b) (the f32 d of iq_unpack.h) and chunks(b, f), which calls
// f(c, u, sign, s16) for c = 0..7 in order.

// IQ4_XS's eight scales ls - 32 as int16 lanes c = 0..7: the low 4 bits from nibble c of scales_l
// (bytes c / 2, low nibble first), bits 4-5 from bits 2c, 2c+1 of scales_h. The per-lane shifts
// are multiplications by powers of two (16-bit lanes: no bit of a lane's field leaves the lane).
inline __m128i iq4_xs_scales16(const block_iq4_xs* b) {
    const __m128i bytes =
        _mm_shuffle_epi8(_mm_cvtsi32_si128(static_cast<int>(load_u32_any(b->scales_l))),
                         _mm_setr_epi8(0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3, -1));
    // Even lanes shifted left by 4 first, so one right shift by 4 leaves each lane's nibble at bit 0.
    const __m128i low =
        _mm_and_si128(_mm_srli_epi16(_mm_mullo_epi16(bytes, _mm_setr_epi16(16, 1, 16, 1, 16, 1, 16, 1)), 4),
                      _mm_set1_epi16(15));
    // Bits 2c, 2c+1 moved to bits 14, 15 of lane c, then down to bits 4, 5.
    const __m128i high = _mm_and_si128(
        _mm_srli_epi16(
            _mm_mullo_epi16(_mm_set1_epi16(static_cast<short>(b->scales_h)),
                            _mm_setr_epi16(1 << 14, 1 << 12, 1 << 10, 1 << 8, 1 << 6, 1 << 4, 1 << 2, 1)),
            10),
        _mm_set1_epi16(0x30));
    return _mm_sub_epi16(_mm_or_si128(low, high), _mm_set1_epi16(32));
}

// Nibbles of 16 bytes as 32 bytes: elements 0..15 the low nibbles, 16..31 the high ones (the
// 16 bytes broadcast to both halves by the load, one variable shift, one mask).
inline __m256i nibbles32(const uint8_t* qs) {
    const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    return _mm256_and_si256(_mm256_srlv_epi64(q, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
}

// Chunk c (elements 32c .. 32c + 31) is qs[16c .. 16c + 15]: low nibbles first, then the high
// ones, so each chunk is decoded on its own (nibbles32, one table lookup) right before its
// products. Decoding two chunks from one 32-byte load needed lane permutes and kept both chunks'
// three vectors live beside a tile's 8 accumulators: GCC spilled the accumulators to the stack
// every chunk (perf annotate), and the 8-token tile ran at 13 multiply-adds per cycle. The scales
// go through memory as int32 (ls - 32 in both halves), so each chunk's broadcast is a load
// rather than a shuffle of a register kept live for the whole block.
struct KIQ4_XS {
    using Block = block_iq4_xs;
    static constexpr bool kChunks = true;
    static float scale(const Block* b) { return half_to_float(b->d); }
    template <typename F>
    static void chunks(const Block* b, F&& f) {
        const __m128i scales = iq4_xs_scales16(b);
        alignas(32) int32_t scale_pairs[8];
        _mm_store_si128(reinterpret_cast<__m128i*>(scale_pairs), _mm_unpacklo_epi16(scales, scales));
        _mm_store_si128(reinterpret_cast<__m128i*>(scale_pairs + 4), _mm_unpackhi_epi16(scales, scales));
        // Opaque to the optimiser: GCC otherwise forwards the stores into extracts and general
        // register round trips (vpextrd, vmovd, vpbroadcastd: three shuffle-port operations).
        __asm__("" : "+m"(scale_pairs));
        const __m256i table =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nlValues)));
        for (int c = 0; c < QK_K / 32; ++c) {
            const __m256i v = _mm256_shuffle_epi8(table, nibbles32(b->qs + 16 * c));
            f(c, _mm256_abs_epi8(v), v, _mm256_set1_epi32(scale_pairs[c]));
        }
    }
};

// The sign operand of an IQ2_XXS / IQ3_XXS chunk from the 28 low bits of `aux`: four 7-bit fields,
// field l for elements 8l .. 8l + 7: element 8l + j (j < 7) is negated where bit j of the field is
// set, element 8l + 7 where the field has an odd number of set bits (kIqKsigns' eighth bit: every
// 8 elements have an even number of negatives). All in vector registers, no table:
//   fields: lanes 2l (and 2l + 1) = aux >> 7l, whose low byte holds field l in bits 0-6;
//   keep:   byte 8l + j = 0xFF where bit j of field l is clear (j < 7), byte 8l + 7 = 0xFF;
//   parity: vpsadbw sums the 8 keep bytes of each 64-bit group, 255 * (8 - negatives among j < 7),
//           odd exactly when those negatives are odd; its bit 0 moved to bit 63 (byte 7's sign bit)
//           and widened to 0xFF by a signed compare clears byte 7 of keep then;
//   result: keep 0xFF -> +1, 0x00 -> -2 (xor 0xFE).
inline __m256i xxs_chunk_sign(uint32_t aux) {
    const __m256i fields = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(aux)),
                                             _mm256_setr_epi32(0, 0, 7, 7, 14, 14, 21, 21));
    const __m256i spread =
        _mm256_shuffle_epi8(fields, _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8, 0, 0, 0,
                                                     0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8));
    const __m256i bit = _mm256_set1_epi64x(0x0040201008040201LL);  // byte 7 tests no bit
    const __m256i zero = _mm256_setzero_si256();
    __m256i keep = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), zero);
    const __m256i odd = _mm256_slli_epi64(_mm256_sad_epu8(keep, zero), 63);
    keep = _mm256_xor_si256(keep, _mm256_cmpgt_epi8(zero, odd));
    return _mm256_xor_si256(keep, _mm256_set1_epi8(static_cast<char>(0xFE)));
}

// The scale 2 ls + 1 of an IQ2_XXS / IQ3_XXS chunk (ls: the top 4 bits of `aux`) in all 16 lanes.
inline __m256i xxs_chunk_scale(uint32_t aux) {
    return _mm256_set1_epi16(static_cast<short>(2 * (aux >> 28) + 1));
}

// IQ2_XXS chunk ib: 8 bytes qs[4ib..4ib+3]: 4 grid indices (rows of 8), then the signs and ls. The
// rows are loaded one by one rather than with vpgather: on the AMD EPYC (Zen) these machines have,
// the gathers ran slower (bench_kernels.py, AVX2, 1 thread: IQ2_XXS 0.84 vs 1.23 GB/s, IQ3_XXS
// 1.3-1.5 vs 1.9, with the earlier decoders).
struct KIQ2_XXS {
    using Block = block_iq2_xxs;
    static constexpr bool kChunks = true;
    static float scale(const Block* b) { return half_to_float(b->d) * 0.125f; }
    template <typename F>
    static void chunks(const Block* b, F&& f) {
        for (int ib = 0; ib < QK_K / 32; ++ib) {
            uint32_t aux[2];
            memcpy(aux, b->qs + 4 * ib, 8);
            const auto row = [](uint32_t index) { return load_i64_any(kIq2xxsGrid[index & 0xFF]); };
            const __m256i rows =
                _mm256_set_epi64x(row(aux[0] >> 24), row(aux[0] >> 16), row(aux[0] >> 8), row(aux[0]));
            f(ib, rows, xxs_chunk_sign(aux[1]), xxs_chunk_scale(aux[1]));
        }
    }
};

// IQ3_XXS chunk ib: grid indices qs[8ib..8ib+7] (rows of 4), then (after all 64 indices) 4 bytes of
// signs and ls, laid out as IQ2_XXS's.
struct KIQ3_XXS {
    using Block = block_iq3_xxs;
    static constexpr bool kChunks = true;
    static float scale(const Block* b) { return half_to_float(b->d) * 0.25f; }
    template <typename F>
    static void chunks(const Block* b, F&& f) {
        const uint8_t* scales_signs = b->qs + QK_K / 4;
        for (int ib = 0; ib < QK_K / 32; ++ib) {
            const uint32_t aux = load_u32_any(scales_signs + 4 * ib);
            const uint8_t* at = b->qs + 8 * ib;
            const auto row = [at](int l) { return static_cast<int>(load_u32_any(kIq3xxsGrid[at[l]])); };
            const __m256i rows =
                _mm256_setr_epi32(row(0), row(1), row(2), row(3), row(4), row(5), row(6), row(7));
            f(ib, rows, xxs_chunk_sign(aux), xxs_chunk_scale(aux));
        }
    }
};

template <typename D, typename = void>
struct HasChunks : std::false_type {};
template <typename D>
struct HasChunks<D, std::void_t<decltype(D::kChunks)>> : std::true_type {};

// One token, software-pipelined as k_dot_one_token: block ib's chunk sums, then block ib - 1's
// reduction and float steps (acc + (dx * d) * float(isum), each rounded as the scalar reference
// rounds it). In block order the loop ran at ~46 cycles per IQ4_XS block against ~27 cycles of
// issue (perf annotate, AVX2, Zen 3): each block ended in one long dependency chain.
template <typename D>
inline float iq_dot_one_token(const typename D::Block* blocks, const block_q8_K* x, int64_t n_blocks) {
    const auto block_sum = [&](int64_t ib) {
        __m256i v = _mm256_setzero_si256();
        D::chunks(blocks + ib, [&](int c, __m256i u, __m256i sign, __m256i s16) {
            v = acc_scaled_pairs(v, u, _mm256_sign_epi8(load256(x[ib].qs + 32 * c), sign), s16);
            keep_in_register(v);
        });
        return v;
    };
    const auto finish = [&](float acc, __m256i v, int64_t ib) {
        return acc + mul_f(mul_f(x[ib].d, D::scale(blocks + ib)), static_cast<float>(hsum_epi32(v)));
    };
    float acc = 0.0f;
    if (n_blocks <= 0) return acc;
    __m256i previous = block_sum(0);
    for (int64_t ib = 1; ib < n_blocks; ++ib) {
        prefetch_ahead(blocks + ib, sizeof(typename D::Block));
        const __m256i current = block_sum(ib);
        acc = finish(acc, previous, ib - 1);
        previous = current;
    }
    return finish(acc, previous, n_blocks - 1);
}

// The row loop of the chunk decoders, for NT tokens: per block the chunks' exact int32 sums, then
// qdot.h's float steps, as iq_dot_one_token (one token) or, for a tile, as k_dot_tokens_256_wide
// does them (the NT sums transposed into one vector, lane t token t), so both give the same bits.
template <typename D, int NT>
inline void iq_dot_tokens(const void* w, const void* xq, size_t xq_stride, int64_t n, float* acc) {
    const typename D::Block* blocks = static_cast<const typename D::Block*>(w);
    if constexpr (NT == 1) {
        acc[0] = iq_dot_one_token<D>(blocks, static_cast<const block_q8_K*>(xq), n / QK_K);
        return;
    }
    const block_q8_K* x[NT];
    for (int t = 0; t < NT; ++t)
        x[t] = reinterpret_cast<const block_q8_K*>(static_cast<const uint8_t*>(xq) + t * xq_stride);
    __m256 accv = _mm256_setzero_ps();
    for (int64_t ib = 0; ib < n / QK_K; ++ib) {
        prefetch_ahead(blocks + ib, sizeof(typename D::Block));
        __m256i v[8];  // hsum8_epi32 reads all eight; the lanes past NT stay zero
        for (auto& lanes : v) lanes = _mm256_setzero_si256();
        D::chunks(blocks + ib, [&](int c, __m256i u, __m256i sign, __m256i s16) {
            for (int t = 0; t < NT; ++t)
                v[t] = acc_scaled_pairs(v[t], u, _mm256_sign_epi8(load256(x[t][ib].qs + 32 * c), sign), s16);
        });
        float dx[8] = {};
        for (int t = 0; t < NT; ++t) dx[t] = x[t][ib].d;
        const __m256 dxv = _mm256_loadu_ps(dx);
        accv = _mm256_add_ps(accv, _mm256_mul_ps(_mm256_mul_ps(dxv, _mm256_set1_ps(D::scale(blocks + ib))),
                                                 _mm256_cvtepi32_ps(hsum8_epi32(v))));
    }
    float all[8];
    _mm256_storeu_ps(all, accv);
    for (int t = 0; t < NT; ++t) acc[t] = all[t];
}

// The row loop of decoder D: the chunk loop for the chunk decoders, k_dot_tokens for the others.
template <typename D, int NT>
inline void row_dot_tokens(const void* w, const void* xq, size_t xq_stride, int64_t n, float* acc) {
    if constexpr (HasChunks<D>::value) {
        iq_dot_tokens<D, NT>(w, xq, xq_stride, n, acc);
    } else {
        k_dot_tokens<D, NT>(w, xq, xq_stride, n, acc);
    }
}

template <typename D>
float k_vec_dot(const void* w, const void* xq, int64_t n) {
    float acc[1];
    row_dot_tokens<D, 1>(w, xq, 0, n, acc);
    return acc[0];
}

template <typename D>
void k_vec_dot_tile(const void* w, const void* xq, size_t xq_stride, int n_tokens, int64_t n, float* y,
                    int64_t ldy) {
    float acc[kMaxTileTokens];
    with_tile_size<kMaxTileTokens>(
        n_tokens, [&](auto nt) { row_dot_tokens<D, decltype(nt)::value>(w, xq, xq_stride, n, acc); });
    for (int t = 0; t < n_tokens; ++t) y[t * ldy] = acc[t];
}

// ---- 32-element blocks ---------------------------------------------------------------------------

// 32 bits -> 32 bytes, byte i = 0xFF where bit i is set.
inline __m256i bits_to_bytes(const uint8_t* p) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int>(bits)),
        _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0));
    const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

struct B32Unpacked {
    __m256i q;  // signed (kSigned) or unsigned quants
    __m128 dm;  // [d, m, -, -]; lane 1 unused (junk) for the types without a min
};

struct B32Q4_0 {
    using Block = block_q4_0;
    using Act = block_q8_0;
    static constexpr bool kSigned = true, kHasMin = false;
    static void decode(const Block* b, B32Unpacked& o) {
        o.dm = _mm_cvtph_ps(_mm_cvtsi32_si128(b->d));
        o.q = _mm256_sub_epi8(nibbles32(b->qs), _mm256_set1_epi8(8));
    }
};
struct B32Q4_1 {
    using Block = block_q4_1;
    using Act = block_q8_1;
    static constexpr bool kSigned = false, kHasMin = true;
    static void decode(const Block* b, B32Unpacked& o) {
        o.dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(load_u32_any(&b->d))));
        o.q = nibbles32(b->qs);
    }
};
struct B32Q5_0 {
    using Block = block_q5_0;
    using Act = block_q8_0;
    static constexpr bool kSigned = true, kHasMin = false;
    static void decode(const Block* b, B32Unpacked& o) {
        o.dm = _mm_cvtph_ps(_mm_cvtsi32_si128(b->d));
        const __m256i high = _mm256_and_si256(bits_to_bytes(b->qh), _mm256_set1_epi8(0x10));
        o.q = _mm256_sub_epi8(_mm256_or_si256(nibbles32(b->qs), high), _mm256_set1_epi8(16));
    }
};
struct B32Q5_1 {
    using Block = block_q5_1;
    using Act = block_q8_1;
    static constexpr bool kSigned = false, kHasMin = true;
    static void decode(const Block* b, B32Unpacked& o) {
        o.dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(load_u32_any(&b->d))));
        o.q =
            _mm256_or_si256(nibbles32(b->qs), _mm256_and_si256(bits_to_bytes(b->qh), _mm256_set1_epi8(0x10)));
    }
};
struct B32Q8_0 {
    using Block = block_q8_0;
    using Act = block_q8_0;
    static constexpr bool kSigned = true, kHasMin = false;
    static void decode(const Block* b, B32Unpacked& o) {
        o.dm = _mm_cvtph_ps(_mm_cvtsi32_si128(b->d));
        o.q = load256(b->qs);
    }
};

struct B32MX4 {
    using Block = block_mxfp4;
    using Act = block_q8_0;
    static constexpr bool kSigned = true, kHasMin = false;
    static void decode(const Block* b, B32Unpacked& o) {
        o.dm = _mm_set_ss(mxfp4_scale(b->e));
        const __m256i table =
            _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kMxfp4Values)));
        o.q = _mm256_shuffle_epi8(table, nibbles32(b->qs));
    }
};

struct B32IQ4_NL {
    using Block = block_iq4_nl;
    using Act = block_q8_0;
    static constexpr bool kSigned = true, kHasMin = false;
    static void decode(const Block* b, B32Unpacked& o) {
        o.dm = _mm_cvtph_ps(_mm_cvtsi32_si128(b->d));
        o.q = iq4_values32_avx2(b->qs);
    }
};

// One block into acc (this block's parity) and, for the min types, msum's lane 1 (qdot.h).
template <typename D, int NT>
inline void b32_step(const B32Unpacked& o, const typename D::Act* const* x, int64_t ib, __m256* acc,
                     __m128* msum) {
    // Signed weights: |w| as the unsigned operand, the sign moved onto the activations.
    const __m256i u = D::kSigned ? _mm256_sign_epi8(o.q, o.q) : o.q;
    for (int t = 0; t < NT; ++t) {
        const typename D::Act& xb = x[t][ib];
        const __m256i xv = D::kSigned ? _mm256_sign_epi8(load256(xb.qs), o.q) : load256(xb.qs);
        const __m256 lanes = _mm256_cvtepi32_ps(dot_quads(u, xv));
        // [dw, mw] * [dx, s]: dw * dx (one f32 rounding, as the scalar dw * dx) and mw * s in one
        // multiply; lane 1 is unused for the types without a min (q8_0 has no s: junk there).
        const __m128 p =
            _mm_mul_ps(o.dm, _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(load_u32_any(&xb.d)))));
        if constexpr (D::kHasMin) msum[t] = _mm_add_ps(msum[t], p);
        acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_broadcastss_ps(p), lanes));
    }
}

template <typename D, int NT>
inline void b32_dot_tokens(const void* w, const void* xq, size_t xq_stride, int64_t n, float* out) {
    using Act = typename D::Act;
    const typename D::Block* blocks = static_cast<const typename D::Block*>(w);
    const Act* x[NT];
    __m256 acc0[NT], acc1[NT];
    __m128 msum0[NT], msum1[NT];  // lane 1: the min terms of even / odd blocks
    for (int t = 0; t < NT; ++t) {
        x[t] = reinterpret_cast<const Act*>(static_cast<const uint8_t*>(xq) + t * xq_stride);
        acc0[t] = _mm256_setzero_ps();
        acc1[t] = _mm256_setzero_ps();
        msum0[t] = _mm_setzero_ps();
        msum1[t] = _mm_setzero_ps();
    }
    const int64_t nb = n / 32;
    int64_t ib = 0;
    for (; ib + 2 <= nb; ib += 2) {
        prefetch_ahead(blocks + ib, 2 * sizeof(typename D::Block));
        B32Unpacked o;
        D::decode(blocks + ib, o);
        b32_step<D, NT>(o, x, ib, acc0, msum0);
        D::decode(blocks + ib + 1, o);
        b32_step<D, NT>(o, x, ib + 1, acc1, msum1);
    }
    if (ib < nb) {
        B32Unpacked o;
        D::decode(blocks + ib, o);
        b32_step<D, NT>(o, x, ib, acc0, msum0);
    }
    for (int t = 0; t < NT; ++t) {
        float r = tree8(_mm256_add_ps(acc0[t], acc1[t]));
        if constexpr (D::kHasMin) {
            const __m128 m = _mm_add_ps(msum0[t], msum1[t]);
            r = r + _mm_cvtss_f32(_mm_movehdup_ps(m));
        }
        out[t] = r;
    }
}

template <typename D>
float b32_vec_dot(const void* w, const void* xq, int64_t n) {
    float out[1];
    b32_dot_tokens<D, 1>(w, xq, 0, n, out);
    return out[0];
}

template <typename D>
void b32_vec_dot_tile(const void* w, const void* xq, size_t xq_stride, int n_tokens, int64_t n, float* y,
                      int64_t ldy) {
    // At most 4 tokens per pass: each token keeps four vector accumulators, so wider passes would
    // spill. Every token's arithmetic is its own, so the passes give the same bits as one.
    for (int t0 = 0; t0 < n_tokens; t0 += 4) {
        const void* xt = static_cast<const uint8_t*>(xq) + static_cast<size_t>(t0) * xq_stride;
        float out[4];
        const int nt = n_tokens - t0 < 4 ? n_tokens - t0 : 4;
        with_tile_size<4>(
            nt, [&](auto tile) { b32_dot_tokens<D, decltype(tile)::value>(w, xt, xq_stride, n, out); });
        for (int t = 0; t < nt; ++t) y[(t0 + t) * ldy] = out[t];
    }
}
