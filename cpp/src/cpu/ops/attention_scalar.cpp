// Scalar reference of the attention kernels (attention_kernels.h): the SIMD tables must return
// these bits (tests compare them). Every step is one IEEE operation as the header lists them;
// std::fma rounds once like the SIMD fmas, and the build does not contract a * b + c in these files.
#include <cmath>
#include <cstring>

#include "cpu/ops/attention_kernels.h"
#include "quant/fp16.h"

namespace sharpi::cpu::detail {
namespace {

void axpy_scalar(float a, const float* x, float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

void scale_scalar(float a, float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] *= a;
}

constexpr AttentionVecKernels kScalar{&axpy_scalar, &scale_scalar};

constexpr int kLanes = static_cast<int>(kAttentionLanes);

// ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)): the order the SIMD horizontal sums take.
float lane_tree(const float* x) {
    return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
}

// A K or V element as f32: f32 rows as they are, f16 rows converted (exactly).
inline float element(const float* row, int64_t d) {
    return row[d];
}
inline float element(const uint16_t* row, int64_t d) {
    return fp16_to_fp32(row[d]);
}

template <typename T>
float score_scalar(const float* q, const T* k, int64_t head_dim, float scale) {
    float lane[kLanes] = {};
    for (int64_t d = 0; d < head_dim; d += kLanes) {
        for (int i = 0; i < kLanes; ++i) lane[i] = std::fma(q[d + i], element(k, d + i), lane[i]);
    }
    return lane_tree(lane) * scale;
}

template <typename T>
void scores_scalar(const float* const* q_rows, int64_t n_rows, const T* k, int64_t ld_k, int64_t j_begin,
                   int64_t j_end, int64_t head_dim, float scale, float* s, int64_t ld_s) {
    for (int64_t r = 0; r < n_rows; ++r) {
        for (int64_t j = j_begin; j < j_end; ++j)
            s[r * ld_s + j] = score_scalar(q_rows[r], k + j * ld_k, head_dim, scale);
    }
}

// exp8 of attention_kernels.h for x <= 0.
float exp_nonpositive(float x) {
    constexpr float kExpMin = -87.3365f;  // ~ln(FLT_MIN): below it e^x is not a normal float
    if (x < kExpMin) return 0.0f;
    const float n = std::nearbyint(x * 1.44269504f);
    float r = std::fma(-n, 0.693359375f, x);
    r = std::fma(-n, -2.12194440e-4f, r);
    float p = 1.0f / 5040.0f;
    p = std::fma(p, r, 1.0f / 720.0f);
    p = std::fma(p, r, 1.0f / 120.0f);
    p = std::fma(p, r, 1.0f / 24.0f);
    p = std::fma(p, r, 1.0f / 6.0f);
    p = std::fma(p, r, 0.5f);
    p = std::fma(p, r, 1.0f);
    p = std::fma(p, r, 1.0f);
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
    float two_n;
    std::memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

float softmax_scalar(float* s, int64_t a, int64_t b, float* m_out) {
    float m = -INFINITY;
    for (int64_t j = a; j < b; ++j) m = std::fmax(m, s[j]);
    float lane[kLanes] = {};
    for (int64_t j = a; j < b; j += kLanes) {
        for (int i = 0; i < kLanes; ++i) {
            s[j + i] = exp_nonpositive(s[j + i] - m);
            lane[i] += s[j + i];
        }
    }
    *m_out = m;
    return lane_tree(lane);
}

template <typename T>
void pv_scalar(const float* p, int64_t ld_p, int64_t n_rows, const T* v, int64_t ld_v, int64_t j_begin,
               int64_t j_end, int64_t head_dim, float* const* o_rows) {
    for (int64_t r = 0; r < n_rows; ++r) {
        for (int64_t j = j_begin; j < j_end; ++j) {
            const float pj = p[r * ld_p + j];
            for (int64_t d = 0; d < head_dim; ++d)
                o_rows[r][d] = std::fma(pj, element(v + j * ld_v, d), o_rows[r][d]);
        }
    }
}

constexpr AttentionBlockKernels kBlockScalar{&scores_scalar<float>, &softmax_scalar, &pv_scalar<float>,
                                             &scores_scalar<uint16_t>, &pv_scalar<uint16_t>};

}  // namespace

const AttentionVecKernels& attention_vec_scalar() {
    return kScalar;
}

const AttentionBlockKernels& attention_block_scalar() {
    return kBlockScalar;
}

}  // namespace sharpi::cpu::detail
