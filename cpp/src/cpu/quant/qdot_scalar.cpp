// Scalar reference of the fast-mode kernels: the plain statement of the arithmetic in qdot.h,
// which the SIMD files reproduce bit for bit. Weight blocks are first unpacked to small integers
// (KBlock / B32Block), then dotted with the quantized activations in int32 and combined in f32
// exactly as qdot.h writes it (this file is built with -ffp-contract=off: no fused multiply-add).
#include <cmath>
#include <cstring>

#include "cpu/quant/iq_unpack.h"
#include "cpu/quant/qdot_impl.h"
#include "quant/fp16.h"

namespace sharpi::cpu::detail {
namespace {

// ---- activation quantizers ---------------------------------------------------------------------

// One block of `count` values: returns d; q receives round-half-even(x * 127 / amax).
float quantize_block(const float* x, int count, int8_t* q) {
    float amax = 0.0f;
    for (int i = 0; i < count; ++i) amax = std::fmax(amax, std::fabs(x[i]));
    const float d = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < count; ++i) q[i] = static_cast<int8_t>(std::nearbyint(x[i] * id));
    return d;
}

void quantize_q8_0(const float* x, void* dst, int64_t n) {
    block_q8_0* y = static_cast<block_q8_0*>(dst);
    for (int64_t ib = 0; ib < n / QK8_0; ++ib) {
        y[ib].d = fp32_to_fp16(quantize_block(x + ib * QK8_0, QK8_0, y[ib].qs));
    }
}

void quantize_q8_1(const float* x, void* dst, int64_t n) {
    block_q8_1* y = static_cast<block_q8_1*>(dst);
    for (int64_t ib = 0; ib < n / QK8_0; ++ib) {
        const float d = quantize_block(x + ib * QK8_0, QK8_0, y[ib].qs);
        int sum = 0;
        for (int i = 0; i < QK8_0; ++i) sum += y[ib].qs[i];
        y[ib].d = fp32_to_fp16(d);
        y[ib].s = fp32_to_fp16(static_cast<float>(sum) * d);
    }
}

void quantize_q8_K(const float* x, void* dst, int64_t n) {
    block_q8_K* y = static_cast<block_q8_K*>(dst);
    for (int64_t ib = 0; ib < n / QK_K; ++ib) {
        y[ib].d = quantize_block(x + ib * QK_K, QK_K, y[ib].qs);
        for (int s = 0; s < QK_K / 16; ++s) {
            int sum = 0;
            for (int i = 0; i < 16; ++i) sum += y[ib].qs[16 * s + i];
            y[ib].bsums[s] = static_cast<int16_t>(sum);
        }
    }
}

// ---- K-quants ------------------------------------------------------------------------------------

// A K-quant block as w[e] = d * sc[e / 16] * (u[e] - kOffset) - dmin * mn[e / 16]; u is signed
// for the IQ types (KIq), unsigned for the K-quants.
struct KBlock {
    int16_t u[QK_K];
    int8_t sc[16];
    uint8_t mn[16];
    float d, dmin;
};

// Q4_K / Q5_K: per-32 scales and mins, repeated for both 16-element halves.
void q4_K_scales16(const uint8_t* packed, KBlock& k) {
    const Q4KScaleWords w = unpack_q4_K_scale_min(packed);
    uint8_t sc[8], mn[8];
    memcpy(sc, &w.sc_lo, 4);
    memcpy(sc + 4, &w.sc_hi, 4);
    memcpy(mn, &w.m_lo, 4);
    memcpy(mn + 4, &w.m_hi, 4);
    for (int s = 0; s < 16; ++s) {
        k.sc[s] = static_cast<int8_t>(sc[s / 2]);
        k.mn[s] = mn[s / 2];
    }
}

struct KQ4_K {
    using Block = block_q4_K;
    static constexpr int kOffset = 0;
    static constexpr bool kHasMin = true;
    static void decode(const Block* b, KBlock& k) {
        k.d = fp16_to_fp32(b->d);
        k.dmin = fp16_to_fp32(b->dmin);
        q4_K_scales16(b->scales, k);
        for (int j = 0; j < 4; ++j) {
            for (int i = 0; i < 32; ++i) {
                k.u[64 * j + i] = b->qs[32 * j + i] & 0x0F;
                k.u[64 * j + 32 + i] = b->qs[32 * j + i] >> 4;
            }
        }
    }
};

struct KQ5_K {
    using Block = block_q5_K;
    static constexpr int kOffset = 0;
    static constexpr bool kHasMin = true;
    static void decode(const Block* b, KBlock& k) {
        k.d = fp16_to_fp32(b->d);
        k.dmin = fp16_to_fp32(b->dmin);
        q4_K_scales16(b->scales, k);
        for (int j = 0; j < 4; ++j) {
            for (int i = 0; i < 32; ++i) {
                k.u[64 * j + i] =
                    static_cast<uint8_t>((b->qs[32 * j + i] & 0x0F) | ((b->qh[i] >> (2 * j)) & 1) << 4);
                k.u[64 * j + 32 + i] =
                    static_cast<uint8_t>((b->qs[32 * j + i] >> 4) | ((b->qh[i] >> (2 * j + 1)) & 1) << 4);
            }
        }
    }
};

struct KQ6_K {
    using Block = block_q6_K;
    static constexpr int kOffset = 32;
    static constexpr bool kHasMin = false;
    static void decode(const Block* b, KBlock& k) {
        k.d = fp16_to_fp32(b->d);
        k.dmin = 0.0f;
        for (int s = 0; s < 16; ++s) {
            k.sc[s] = b->scales[s];
            k.mn[s] = 0;
        }
        for (int h = 0; h < 2; ++h) {
            for (int c = 0; c < 4; ++c) {
                for (int i = 0; i < 32; ++i) {
                    const uint8_t l = b->ql[64 * h + 32 * (c % 2) + i];
                    const int low = c < 2 ? (l & 0x0F) : (l >> 4);
                    const int high = (b->qh[32 * h + i] >> (2 * c)) & 3;
                    k.u[128 * h + 32 * c + i] = static_cast<uint8_t>(low | high << 4);
                }
            }
        }
    }
};

struct KQ3_K {
    using Block = block_q3_K;
    static constexpr int kOffset = 4;
    static constexpr bool kHasMin = false;
    static void decode(const Block* b, KBlock& k) {
        k.d = fp16_to_fp32(b->d);
        k.dmin = 0.0f;
        uint32_t words[4];
        unpack_q3_K_scales(b->scales, words);
        uint8_t biased[16];
        memcpy(biased, words, 16);
        for (int s = 0; s < 16; ++s) {
            k.sc[s] = static_cast<int8_t>(biased[s] - 32);
            k.mn[s] = 0;
        }
        // Element 128h + 32j + i: low 2 bits of qs[32h + i] at bit 2j, high bit of hmask[i] at 4h + j.
        for (int h = 0; h < 2; ++h) {
            for (int j = 0; j < 4; ++j) {
                for (int i = 0; i < 32; ++i) {
                    const int low = (b->qs[32 * h + i] >> (2 * j)) & 3;
                    const int high = (b->hmask[i] >> (4 * h + j)) & 1;
                    k.u[128 * h + 32 * j + i] = static_cast<uint8_t>(low | high << 2);
                }
            }
        }
    }
};

struct KQ2_K {
    using Block = block_q2_K;
    static constexpr int kOffset = 0;
    static constexpr bool kHasMin = true;
    static void decode(const Block* b, KBlock& k) {
        k.d = fp16_to_fp32(b->d);
        k.dmin = fp16_to_fp32(b->dmin);
        for (int s = 0; s < 16; ++s) {
            k.sc[s] = static_cast<int8_t>(b->scales[s] & 0x0F);
            k.mn[s] = b->scales[s] >> 4;
        }
        for (int h = 0; h < 2; ++h) {
            for (int j = 0; j < 4; ++j) {
                for (int i = 0; i < 32; ++i) k.u[128 * h + 32 * j + i] = (b->qs[32 * h + i] >> (2 * j)) & 3;
            }
        }
    }
};

// The 256-element IQ types (iq_unpack.h) as K-blocks: w = d * sc * q, no offset, no min.
template <typename B, void (*Unpack)(const B*, IqUnpacked&)>
struct KIq {
    using Block = B;
    static constexpr int kOffset = 0;
    static constexpr bool kHasMin = false;
    static void decode(const Block* b, KBlock& k) {
        IqUnpacked iq;
        Unpack(b, iq);
        k.d = iq.d;
        k.dmin = 0.0f;
        for (int s = 0; s < 16; ++s) {
            k.sc[s] = iq.sc[s];
            k.mn[s] = 0;
        }
        for (int e = 0; e < QK_K; ++e) k.u[e] = iq.q[e];
    }
};

// The names the SIMD files give their own decoders of these types (the table is shared).
using KIQ4_XS = KIq<block_iq4_xs, unpack_iq4_xs>;
using KIQ3_XXS = KIq<block_iq3_xxs, unpack_iq3_xxs>;
using KIQ2_XXS = KIq<block_iq2_xxs, unpack_iq2_xxs>;

// acc after one more block (qdot.h).
float k_block_step(float acc, const KBlock& k, const block_q8_K& x, int offset, bool has_min) {
    int32_t isum = 0, imin = 0;
    for (int s = 0; s < 16; ++s) {
        int32_t dot = 0;
        for (int i = 16 * s; i < 16 * s + 16; ++i) dot += static_cast<int32_t>(k.u[i]) * x.qs[i];
        isum += k.sc[s] * dot;
    }
    int32_t sc_bsums = 0;
    for (int s = 0; s < 16; ++s) {
        sc_bsums += k.sc[s] * x.bsums[s];
        imin += k.mn[s] * x.bsums[s];
    }
    isum -= offset * sc_bsums;
    acc = acc + (x.d * k.d) * static_cast<float>(isum);
    if (has_min) acc = acc - (x.d * k.dmin) * static_cast<float>(imin);
    return acc;
}

template <typename D>
void k_vec_dot_tile(const void* w, const void* xq, size_t xq_stride, int n_tokens, int64_t n, float* y,
                    int64_t ldy) {
    const typename D::Block* blocks = static_cast<const typename D::Block*>(w);
    float acc[kMaxTileTokens] = {};
    KBlock k;
    for (int64_t ib = 0; ib < n / QK_K; ++ib) {
        D::decode(blocks + ib, k);
        for (int t = 0; t < n_tokens; ++t) {
            const block_q8_K* x =
                reinterpret_cast<const block_q8_K*>(static_cast<const uint8_t*>(xq) + t * xq_stride);
            acc[t] = k_block_step(acc[t], k, x[ib], D::kOffset, D::kHasMin);
        }
    }
    for (int t = 0; t < n_tokens; ++t) y[t * ldy] = acc[t];
}

template <typename D>
float k_vec_dot(const void* w, const void* xq, int64_t n) {
    float y;
    k_vec_dot_tile<D>(w, xq, 0, 1, n, &y, 1);
    return y;
}

// ---- 32-element blocks ---------------------------------------------------------------------------

// w[i] = d * q[i] (+ m): q signed for Q4_0 / Q5_0 / Q8_0, unsigned for Q4_1 / Q5_1.
struct B32Block {
    int q[32];
    float d, m;
};

uint32_t q5_high_bits(const uint8_t qh[4]) {
    uint32_t v;
    memcpy(&v, qh, 4);
    return v;
}

struct B32Q4_0 {
    using Block = block_q4_0;
    using Act = block_q8_0;
    static constexpr bool kHasMin = false;
    static void decode(const Block* b, B32Block& o) {
        o.d = fp16_to_fp32(b->d);
        for (int j = 0; j < 16; ++j) {
            o.q[j] = (b->qs[j] & 0x0F) - 8;
            o.q[j + 16] = (b->qs[j] >> 4) - 8;
        }
    }
};

struct B32Q4_1 {
    using Block = block_q4_1;
    using Act = block_q8_1;
    static constexpr bool kHasMin = true;
    static void decode(const Block* b, B32Block& o) {
        o.d = fp16_to_fp32(b->d);
        o.m = fp16_to_fp32(b->m);
        for (int j = 0; j < 16; ++j) {
            o.q[j] = b->qs[j] & 0x0F;
            o.q[j + 16] = b->qs[j] >> 4;
        }
    }
};

struct B32Q5_0 {
    using Block = block_q5_0;
    using Act = block_q8_0;
    static constexpr bool kHasMin = false;
    static void decode(const Block* b, B32Block& o) {
        o.d = fp16_to_fp32(b->d);
        const uint32_t qh = q5_high_bits(b->qh);
        for (int j = 0; j < 16; ++j) {
            o.q[j] = ((b->qs[j] & 0x0F) | static_cast<int>((qh >> j) & 1u) << 4) - 16;
            o.q[j + 16] = ((b->qs[j] >> 4) | static_cast<int>((qh >> (j + 16)) & 1u) << 4) - 16;
        }
    }
};

struct B32Q5_1 {
    using Block = block_q5_1;
    using Act = block_q8_1;
    static constexpr bool kHasMin = true;
    static void decode(const Block* b, B32Block& o) {
        o.d = fp16_to_fp32(b->d);
        o.m = fp16_to_fp32(b->m);
        const uint32_t qh = q5_high_bits(b->qh);
        for (int j = 0; j < 16; ++j) {
            o.q[j] = (b->qs[j] & 0x0F) | static_cast<int>((qh >> j) & 1u) << 4;
            o.q[j + 16] = (b->qs[j] >> 4) | static_cast<int>((qh >> (j + 16)) & 1u) << 4;
        }
    }
};

struct B32Q8_0 {
    using Block = block_q8_0;
    using Act = block_q8_0;
    static constexpr bool kHasMin = false;
    static void decode(const Block* b, B32Block& o) {
        o.d = fp16_to_fp32(b->d);
        for (int j = 0; j < 32; ++j) o.q[j] = b->qs[j];
    }
};

struct B32MX4 {
    using Block = block_mxfp4;
    using Act = block_q8_0;
    static constexpr bool kHasMin = false;
    static void decode(const Block* b, B32Block& o) {
        o.d = mxfp4_scale(b->e);
        for (int j = 0; j < 16; ++j) {
            o.q[j] = kMxfp4Values[b->qs[j] & 0x0F];
            o.q[j + 16] = kMxfp4Values[b->qs[j] >> 4];
        }
    }
};

struct B32IQ4_NL {
    using Block = block_iq4_nl;
    using Act = block_q8_0;
    static constexpr bool kHasMin = false;
    static void decode(const Block* b, B32Block& o) {
        o.d = fp16_to_fp32(b->d);
        int8_t q[QK4_NL];
        unpack_iq4_nl(b, q);
        for (int j = 0; j < QK4_NL; ++j) o.q[j] = q[j];
    }
};

inline float act_s(const block_q8_0&) {
    return 0.0f;
}
inline float act_s(const block_q8_1& x) {
    return fp16_to_fp32(x.s);
}

template <typename D>
void b32_vec_dot_tile(const void* w, const void* xq, size_t xq_stride, int n_tokens, int64_t n, float* y,
                      int64_t ldy) {
    using Act = typename D::Act;
    const typename D::Block* blocks = static_cast<const typename D::Block*>(w);
    float acc[kMaxTileTokens][2][8] = {};
    float msum[kMaxTileTokens][2] = {};
    B32Block o;
    for (int64_t ib = 0; ib < n / 32; ++ib) {
        D::decode(blocks + ib, o);
        for (int t = 0; t < n_tokens; ++t) {
            const Act& x = reinterpret_cast<const Act*>(static_cast<const uint8_t*>(xq) + t * xq_stride)[ib];
            const float dd = o.d * fp16_to_fp32(x.d);
            float* a = acc[t][ib % 2];
            for (int l = 0; l < 8; ++l) {
                int32_t lane = 0;
                for (int i = 4 * l; i < 4 * l + 4; ++i) lane += o.q[i] * x.qs[i];
                a[l] = a[l] + dd * static_cast<float>(lane);
            }
            if (D::kHasMin) msum[t][ib % 2] = msum[t][ib % 2] + o.m * act_s(x);
        }
    }
    for (int t = 0; t < n_tokens; ++t) {
        float a[8];
        for (int l = 0; l < 8; ++l) a[l] = acc[t][0][l] + acc[t][1][l];
        float r = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
        if (D::kHasMin) r = r + (msum[t][0] + msum[t][1]);
        y[t * ldy] = r;
    }
}

template <typename D>
float b32_vec_dot(const void* w, const void* xq, int64_t n) {
    float y;
    b32_vec_dot_tile<D>(w, xq, 0, 1, n, &y, 1);
    return y;
}

SHARPI_QDOT_TABLE(kScalarQuantKernels)

}  // namespace

const QuantIsaKernels& scalar_quant_kernels() {
    return kScalarQuantKernels;
}

}  // namespace sharpi::cpu::detail
