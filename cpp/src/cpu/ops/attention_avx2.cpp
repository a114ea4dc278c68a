// AVX2 + FMA attention kernels (attention_kernels.h): the vector kernels (8 lanes, masked tail) and
// fast mode's block kernels, register-blocked so that loads are shared between rows and keys.
#include <immintrin.h>

#include <cmath>

#include "cpu/ops/attention_kernels.h"

namespace sharpi::cpu::detail {
namespace {

inline __m256i first_lanes(int64_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Eight K or V elements as f32: f32 rows loaded, f16 rows converted (exactly, F16C).
inline __m256 load8(const float* p) {
    return _mm256_loadu_ps(p);
}
inline __m256 load8(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
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

// Fast mode's block kernels. Register tiles: scores take kScoreRows query rows x kScoreKeys keys
// (12 accumulators; per 8 dims 3 + 4 loads feed 12 fmas, where one dot alone needs 2 loads per
// fma), pv takes kPvRows rows x kPvVecs vectors of 8 dims (12 accumulators; per key 4 loads and 3
// broadcasts feed 12 fmas). Tails run the same arithmetic on smaller tiles.
constexpr int kScoreRows = 3;
constexpr int kScoreKeys = 4;
constexpr int kPvRows = 3;
constexpr int kPvVecs = 4;

// ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)) of each of a[0..3], as lanes 0..3.
inline __m128 lane_tree4(const __m256* a) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// The same tree of one vector.
inline float lane_tree1(__m256 a) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, a), a);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

template <int R, int C, typename T>
inline void score_tile(const float* const* q, const T* k, int64_t ld_k, int64_t head_dim,
                       __m256 (&acc)[R][C]) {
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
        __m256 kv[C];
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) kv[c] = load8(k + c * ld_k + d);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            const __m256 qv = _mm256_loadu_ps(q[r] + d);
#pragma GCC unroll 4
            for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(qv, kv[c], acc[r][c]);
        }
    }
}

template <int R, typename T>
void score_rows(const float* const* q, const T* k, int64_t ld_k, int64_t j_begin, int64_t j_end,
                int64_t head_dim, float scale, float* s, int64_t ld_s) {
    const __m128 vscale = _mm_set1_ps(scale);
    int64_t j = j_begin;
    for (; j + kScoreKeys <= j_end; j += kScoreKeys) {
        __m256 acc[R][kScoreKeys];
        score_tile<R, kScoreKeys>(q, k + j * ld_k, ld_k, head_dim, acc);
        for (int r = 0; r < R; ++r) _mm_storeu_ps(s + r * ld_s + j, _mm_mul_ps(lane_tree4(acc[r]), vscale));
    }
    for (; j < j_end; ++j) {
        __m256 acc[R][1];
        score_tile<R, 1>(q, k + j * ld_k, ld_k, head_dim, acc);
        for (int r = 0; r < R; ++r) s[r * ld_s + j] = lane_tree1(acc[r][0]) * scale;
    }
}

template <typename T>
void scores_avx2(const float* const* q_rows, int64_t n_rows, const T* k, int64_t ld_k, int64_t j_begin,
                 int64_t j_end, int64_t head_dim, float scale, float* s, int64_t ld_s) {
    int64_t r = 0;
    for (; r + kScoreRows <= n_rows; r += kScoreRows)
        score_rows<kScoreRows>(q_rows + r, k, ld_k, j_begin, j_end, head_dim, scale, s + r * ld_s, ld_s);
    if (n_rows - r == 2)
        score_rows<2>(q_rows + r, k, ld_k, j_begin, j_end, head_dim, scale, s + r * ld_s, ld_s);
    if (n_rows - r == 1)
        score_rows<1>(q_rows + r, k, ld_k, j_begin, j_end, head_dim, scale, s + r * ld_s, ld_s);
}

// exp8 of attention_kernels.h for x <= 0 (x = -inf gives 0).
inline __m256 exp_nonpositive(__m256 x) {
    const __m256 exp_min = _mm256_set1_ps(-87.3365f);
    const __m256 underflow = _mm256_cmp_ps(x, exp_min, _CMP_LT_OQ);
    x = _mm256_max_ps(x, exp_min);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i bits =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

float softmax_avx2(float* s, int64_t a, int64_t b, float* m_out) {
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (int64_t j = a; j < b; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + j));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float m = _mm_cvtss_f32(m4);
    const __m256 vm = _mm256_set1_ps(m);
    __m256 l = _mm256_setzero_ps();
    for (int64_t j = a; j < b; j += 8) {
        const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
        _mm256_storeu_ps(s + j, p);
        l = _mm256_add_ps(l, p);
    }
    *m_out = m;
    return lane_tree1(l);
}

// One tile: R rows x V vectors of 8 dims, R * V accumulators, per key V loads, R broadcasts and
// R * V fmas. Tiles of 8 or 12 accumulators keep both FMA pipes busy through the 4-cycle fma
// latency (a 1x4 tile, 4 fmas per key, waited on it). The loops over r and i are unrolled whole,
// so the accumulators are registers.
template <int R, int V, typename T>
inline void pv_tile(const float* p, int64_t ld_p, const T* v, int64_t ld_v, int64_t j_begin, int64_t j_end,
                    float* const* o, int64_t d) {
    __m256 a[R][V];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int i = 0; i < V; ++i) a[r][i] = _mm256_loadu_ps(o[r] + d + 8 * i);
    for (int64_t j = j_begin; j < j_end; ++j) {
        const T* vj = v + j * ld_v + d;
        __m256 vv[V];
#pragma GCC unroll 8
        for (int i = 0; i < V; ++i) vv[i] = load8(vj + 8 * i);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            const __m256 pj = _mm256_broadcast_ss(p + r * ld_p + j);
#pragma GCC unroll 8
            for (int i = 0; i < V; ++i) a[r][i] = _mm256_fmadd_ps(pj, vv[i], a[r][i]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int i = 0; i < V; ++i) _mm256_storeu_ps(o[r] + d + 8 * i, a[r][i]);
}

// R rows (kPvRows, 2 or 1) over head_dim: tiles of kPvVecs vectors (one row: of 8 while they
// fit), then single vectors.
template <int R, typename T>
void pv_rows(const float* p, int64_t ld_p, const T* v, int64_t ld_v, int64_t j_begin, int64_t j_end,
             int64_t head_dim, float* const* o) {
    static_assert(R == kPvRows || R == 2 || R == 1, "pv tiles of kPvRows, 2 or 1 rows");
    int64_t d = 0;
    if constexpr (R == 1) {
        for (; d + 64 <= head_dim; d += 64) pv_tile<1, 8>(p, ld_p, v, ld_v, j_begin, j_end, o, d);
    }
    for (; d + 8 * kPvVecs <= head_dim; d += 8 * kPvVecs)
        pv_tile<R, kPvVecs>(p, ld_p, v, ld_v, j_begin, j_end, o, d);
    for (; d < head_dim; d += 8) pv_tile<R, 1>(p, ld_p, v, ld_v, j_begin, j_end, o, d);
}

template <typename T>
void pv_avx2(const float* p, int64_t ld_p, int64_t n_rows, const T* v, int64_t ld_v, int64_t j_begin,
             int64_t j_end, int64_t head_dim, float* const* o_rows) {
    // Rows in tiles of 3, the last 4 as 2 + 2 and a last 2 as one tile (each row's arithmetic is
    // its own whatever tile it is in).
    int64_t r = 0;
    for (; n_rows - r >= kPvRows && n_rows - r != 4; r += kPvRows)
        pv_rows<kPvRows>(p + r * ld_p, ld_p, v, ld_v, j_begin, j_end, head_dim, o_rows + r);
    for (; n_rows - r >= 2; r += 2)
        pv_rows<2>(p + r * ld_p, ld_p, v, ld_v, j_begin, j_end, head_dim, o_rows + r);
    if (r < n_rows) pv_rows<1>(p + r * ld_p, ld_p, v, ld_v, j_begin, j_end, head_dim, o_rows + r);
}

constexpr AttentionBlockKernels kBlockAvx2{&scores_avx2<float>, &softmax_avx2, &pv_avx2<float>,
                                           &scores_avx2<uint16_t>, &pv_avx2<uint16_t>};

}  // namespace

const AttentionVecKernels& attention_vec_avx2() {
    return kAvx2;
}

const AttentionBlockKernels& attention_block_avx2() {
    return kBlockAvx2;
}

}  // namespace sharpi::cpu::detail
