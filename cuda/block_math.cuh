// The per-block arithmetic of every quant type, written once for the CUDA kernels and the host:
// nvcc compiles these as __host__ __device__ functions, the host compiler as plain inline C++
// (block_math_host.cpp), so the host test suite (tests/test_cuda_host.py) checks the math the
// device runs against the gguf package's numpy dequantize on every CI run, GPU or not.
//
// Exact path: bm_dequant<Type>(block, e) is element e of a block, equal bit for bit to numpy.
// Every formula is an f16 scale times small integers (exact in f32) plus or minus another such
// product, or Q6_K's lone (d * sc) * q; so an FMA that nvcc may form gives the same bits as
// multiply-then-add (the argument of cpu/quant/kernels_impl.h).
//
// Int8 path (fast mode on the device): activations are quantized to q8_0 / q8_1 / q8_K exactly as
// the CPU does (cpu/quant/qdot.h: amax / 127, round-half-even, f16 d for the 32-element formats),
// so device and host activations are the same bytes. A weight block dotted with its activation
// block gives one f32 partial per block:
//   32-element types: (dw * dx) * float(isum) [+ mw * s for Q4_1 / Q5_1]
//   K-quants:         (dx * d) * float(isum) - (dx * dmin) * float(imin)
// with isum / imin the exact int32 sums of qdot.h. The float operations go through bm_mul /
// bm_add / bm_sub, which are round-to-nearest without contraction on the device, so host and
// device give the same bits per block; rows sum the block partials in an order of the kernel's
// choosing (tested against a numpy model of the per-block arithmetic).
#pragma once

#include <math.h>
#include <stdint.h>

#include "quant/blocks.h"
#include "quant/fp16.h"
#include "quant/ggml_type.h"
#include "quant/host_device.h"

namespace sharpi::cuda {

#ifdef __CUDA_ARCH__
SHARPI_HD inline float bm_mul(float a, float b) {
    return __fmul_rn(a, b);
}
SHARPI_HD inline float bm_add(float a, float b) {
    return __fadd_rn(a, b);
}
SHARPI_HD inline float bm_sub(float a, float b) {
    return __fsub_rn(a, b);
}
SHARPI_HD inline float bm_rint(float x) {
    return rintf(x);
}
#else
SHARPI_HD inline float bm_mul(float a, float b) {
    return a * b;
}
SHARPI_HD inline float bm_add(float a, float b) {
    return a + b;
}
SHARPI_HD inline float bm_sub(float a, float b) {
    return a - b;
}
SHARPI_HD inline float bm_rint(float x) {
    return __builtin_rintf(x);  // round-half-even in the default rounding mode
}
#endif

// ---- unpacked scales --------------------------------------------------------------------------

// Q4_K / Q5_K: the 6-bit scale and min of sub-block `sub` (0..7) of 32 elements.
SHARPI_HD inline void bm_q4_K_scale_min(const uint8_t* s, int sub, int& sc, int& m) {
    if (sub < 4) {
        sc = s[sub] & 63;
        m = s[sub + 4] & 63;
    } else {
        sc = (s[sub + 4] & 0x0F) | (s[sub - 4] >> 6) << 4;
        m = (s[sub + 4] >> 4) | (s[sub] >> 6) << 4;
    }
}

// Q3_K: the signed 6-bit scale of sub-block `sub` (0..15) of 16 elements (stored biased by 32).
SHARPI_HD inline int bm_q3_K_scale(const uint8_t* s, int sub) {
    const int low = sub < 8 ? (s[sub] & 0x0F) : (s[sub - 8] >> 4);
    const int high = (s[8 + sub % 4] >> (2 * (sub / 4))) & 3;
    return (low | high << 4) - 32;
}

// ---- the unsigned quant of element e, and the per-block constants -----------------------------
// Element layouts (ggml's dequantize_row_* order):
//   Q4_x: e < 16 low nibble of qs[e], else high nibble of qs[e - 16]; Q5_x add bit e of qh.
//   Q2_K / Q3_K: e = 128h + 32j + 16l + i: bits 2j.. of qs[32h + 16l + i]; Q3_K's high bit is
//     bit 4h + j of hmask[16l + i] (set: q, clear: q - 4). Sub-block e / 16.
//   Q4_K / Q5_K: e = 64j + 32hi + i: nibble hi of qs[32j + i]; Q5_K's fifth bit is bit 2j + hi of
//     qh[i]. Sub-block e / 32.
//   Q6_K: e = 128h + 32k + i: nibble (k >= 2) of ql[64h + 32(k % 2) + i], high 2 bits at bit 2k of
//     qh[32h + i]; minus 32. Scale scales[e / 16].

SHARPI_HD inline int bm_nibble32(const uint8_t* qs, int e) {
    return e < 16 ? (qs[e] & 0x0F) : (qs[e - 16] >> 4);
}

SHARPI_HD inline int bm_q5_fifth_bit(const uint8_t* qh, int e) {
    return (qh[e / 8] >> (e % 8)) & 1;
}

SHARPI_HD inline int bm_q2_bits(const uint8_t* qs, int e) {
    const int h = e / 128, j = (e % 128) / 32, l = (e % 32) / 16, i = e % 16;
    return (qs[32 * h + 16 * l + i] >> (2 * j)) & 3;
}

// Q3_K quant in -4..3.
SHARPI_HD inline int bm_q3_K_quant(const block_q3_K* b, int e) {
    const int h = e / 128, j = (e % 128) / 32, l = (e % 32) / 16, i = e % 16;
    const int high = (b->hmask[16 * l + i] >> (4 * h + j)) & 1;
    return bm_q2_bits(b->qs, e) - (high ? 0 : 4);
}

SHARPI_HD inline int bm_q4_K_quant(const uint8_t* qs, int e) {
    const int j = e / 64, hi = (e % 64) / 32, i = e % 32;
    return hi ? (qs[32 * j + i] >> 4) : (qs[32 * j + i] & 0x0F);
}

SHARPI_HD inline int bm_q5_K_quant(const block_q5_K* b, int e) {
    const int sub = e / 32;
    return bm_q4_K_quant(b->qs, e) | ((b->qh[e % 32] >> sub) & 1) << 4;
}

// Q6_K quant in -32..31.
SHARPI_HD inline int bm_q6_K_quant(const block_q6_K* b, int e) {
    const int h = e / 128, k = (e % 128) / 32, i = e % 32;
    const uint8_t l = b->ql[64 * h + 32 * (k % 2) + i];
    const int low = k < 2 ? (l & 0x0F) : (l >> 4);
    const int high = (b->qh[32 * h + i] >> (2 * k)) & 3;
    return (low | high << 4) - 32;
}

// ---- exact path: element e of a block as f32 ----------------------------------------------------

SHARPI_HD inline float bm_dequant(const block_q4_0* b, int e) {
    return fp16_to_fp32(b->d) * static_cast<float>(bm_nibble32(b->qs, e) - 8);
}
SHARPI_HD inline float bm_dequant(const block_q4_1* b, int e) {
    return bm_add(bm_mul(fp16_to_fp32(b->d), static_cast<float>(bm_nibble32(b->qs, e))), fp16_to_fp32(b->m));
}
SHARPI_HD inline float bm_dequant(const block_q5_0* b, int e) {
    const int q = bm_nibble32(b->qs, e) | bm_q5_fifth_bit(b->qh, e) << 4;
    return fp16_to_fp32(b->d) * static_cast<float>(q - 16);
}
SHARPI_HD inline float bm_dequant(const block_q5_1* b, int e) {
    const int q = bm_nibble32(b->qs, e) | bm_q5_fifth_bit(b->qh, e) << 4;
    return bm_add(bm_mul(fp16_to_fp32(b->d), static_cast<float>(q)), fp16_to_fp32(b->m));
}
SHARPI_HD inline float bm_dequant(const block_q8_0* b, int e) {
    return static_cast<float>(b->qs[e]) * fp16_to_fp32(b->d);
}
SHARPI_HD inline float bm_dequant(const block_q2_K* b, int e) {
    const int sc = b->scales[e / 16];
    const float dl = fp16_to_fp32(b->d) * static_cast<float>(sc & 0x0F);
    const float ml = fp16_to_fp32(b->dmin) * static_cast<float>(sc >> 4);
    return bm_sub(bm_mul(dl, static_cast<float>(bm_q2_bits(b->qs, e))), ml);
}
SHARPI_HD inline float bm_dequant(const block_q3_K* b, int e) {
    const float dl = fp16_to_fp32(b->d) * static_cast<float>(bm_q3_K_scale(b->scales, e / 16));
    return dl * static_cast<float>(bm_q3_K_quant(b, e));
}
SHARPI_HD inline float bm_dequant(const block_q4_K* b, int e) {
    int sc, m;
    bm_q4_K_scale_min(b->scales, e / 32, sc, m);
    const float dl = fp16_to_fp32(b->d) * static_cast<float>(sc);
    const float ml = fp16_to_fp32(b->dmin) * static_cast<float>(m);
    return bm_sub(bm_mul(dl, static_cast<float>(bm_q4_K_quant(b->qs, e))), ml);
}
SHARPI_HD inline float bm_dequant(const block_q5_K* b, int e) {
    int sc, m;
    bm_q4_K_scale_min(b->scales, e / 32, sc, m);
    const float dl = fp16_to_fp32(b->d) * static_cast<float>(sc);
    const float ml = fp16_to_fp32(b->dmin) * static_cast<float>(m);
    return bm_sub(bm_mul(dl, static_cast<float>(bm_q5_K_quant(b, e))), ml);
}
SHARPI_HD inline float bm_dequant(const block_q6_K* b, int e) {
    const float dl = fp16_to_fp32(b->d) * static_cast<float>(b->scales[e / 16]);
    return dl * static_cast<float>(bm_q6_K_quant(b, e));
}

// Plain element types, one "block" of one element.
struct bm_f32 {
    float v;
};
struct bm_f16 {
    uint16_t v;
};
struct bm_bf16 {
    uint16_t v;
};
SHARPI_HD inline float bm_dequant(const bm_f32* b, int) {
    return b->v;
}
SHARPI_HD inline float bm_dequant(const bm_f16* b, int) {
    return fp16_to_fp32(b->v);
}
SHARPI_HD inline float bm_dequant(const bm_bf16* b, int) {
    return bf16_to_fp32(b->v);
}

// Elements per block of each block struct, for templates over the block type.
template <typename Block>
struct BmBlockSize;
#define SHARPI_BM_BLOCK_SIZE(Block, n)    \
    template <>                           \
    struct BmBlockSize<Block> {           \
        static constexpr int value = (n); \
    };
SHARPI_BM_BLOCK_SIZE(bm_f32, 1)
SHARPI_BM_BLOCK_SIZE(bm_f16, 1)
SHARPI_BM_BLOCK_SIZE(bm_bf16, 1)
SHARPI_BM_BLOCK_SIZE(block_q4_0, QK4_0)
SHARPI_BM_BLOCK_SIZE(block_q4_1, QK4_1)
SHARPI_BM_BLOCK_SIZE(block_q5_0, QK5_0)
SHARPI_BM_BLOCK_SIZE(block_q5_1, QK5_1)
SHARPI_BM_BLOCK_SIZE(block_q8_0, QK8_0)
SHARPI_BM_BLOCK_SIZE(block_q2_K, QK_K)
SHARPI_BM_BLOCK_SIZE(block_q3_K, QK_K)
SHARPI_BM_BLOCK_SIZE(block_q4_K, QK_K)
SHARPI_BM_BLOCK_SIZE(block_q5_K, QK_K)
SHARPI_BM_BLOCK_SIZE(block_q6_K, QK_K)
#undef SHARPI_BM_BLOCK_SIZE

// ---- int8 path: activation quantization ------------------------------------------------------

// amax of a block of activations (the order of a max does not change it; the device reduces it
// across a warp and gets the same value).
SHARPI_HD inline float bm_absmax(const float* x, int count) {
    float amax = 0.0f;
    for (int i = 0; i < count; ++i) amax = fmaxf(amax, fabsf(x[i]));
    return amax;
}

// Quant of one activation given its block's amax: round-half-even(x * (127 / amax)), 0 when amax is 0.
SHARPI_HD inline int8_t bm_quantize_one(float x, float amax) {
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    return static_cast<int8_t>(bm_rint(bm_mul(x, id)));
}

SHARPI_HD inline void bm_quantize_q8_0(const float* x, block_q8_0* y) {
    const float amax = bm_absmax(x, QK8_0);
    for (int i = 0; i < QK8_0; ++i) y->qs[i] = bm_quantize_one(x[i], amax);
    y->d = fp32_to_fp16(amax / 127.0f);
}

SHARPI_HD inline void bm_quantize_q8_1(const float* x, block_q8_1* y) {
    const float amax = bm_absmax(x, QK8_0);
    int sum = 0;
    for (int i = 0; i < QK8_0; ++i) {
        y->qs[i] = bm_quantize_one(x[i], amax);
        sum += y->qs[i];
    }
    const float d = amax / 127.0f;
    y->d = fp32_to_fp16(d);
    y->s = fp32_to_fp16(bm_mul(static_cast<float>(sum), d));
}

SHARPI_HD inline void bm_quantize_q8_K(const float* x, block_q8_K* y) {
    const float amax = bm_absmax(x, QK_K);
    for (int s = 0; s < QK_K / 16; ++s) {
        int sum = 0;
        for (int i = 0; i < 16; ++i) {
            y->qs[16 * s + i] = bm_quantize_one(x[16 * s + i], amax);
            sum += y->qs[16 * s + i];
        }
        y->bsums[s] = static_cast<int16_t>(sum);
    }
    y->d = amax / 127.0f;
}

// ---- int8 path: one weight block . one activation block -----------------------------------------

// Signed weight quant of the 32-element types (Q4_0: u - 8, Q5_0: u - 16, Q8_0: qs); Q4_1 / Q5_1:
// the unsigned quant, their min enters through the activation block's s.
SHARPI_HD inline int bm_quant32(const block_q4_0* b, int e) {
    return bm_nibble32(b->qs, e) - 8;
}
SHARPI_HD inline int bm_quant32(const block_q4_1* b, int e) {
    return bm_nibble32(b->qs, e);
}
SHARPI_HD inline int bm_quant32(const block_q5_0* b, int e) {
    return (bm_nibble32(b->qs, e) | bm_q5_fifth_bit(b->qh, e) << 4) - 16;
}
SHARPI_HD inline int bm_quant32(const block_q5_1* b, int e) {
    return bm_nibble32(b->qs, e) | bm_q5_fifth_bit(b->qh, e) << 4;
}
SHARPI_HD inline int bm_quant32(const block_q8_0* b, int e) {
    return b->qs[e];
}

template <typename Block>
SHARPI_HD inline int bm_isum32(const Block* w, const int8_t* q) {
    int isum = 0;
    for (int e = 0; e < 32; ++e) isum += bm_quant32(w, e) * q[e];
    return isum;
}

SHARPI_HD inline float bm_dot_q8(const block_q4_0* w, const block_q8_0* x) {
    return bm_mul(bm_mul(fp16_to_fp32(w->d), fp16_to_fp32(x->d)), static_cast<float>(bm_isum32(w, x->qs)));
}
SHARPI_HD inline float bm_dot_q8(const block_q5_0* w, const block_q8_0* x) {
    return bm_mul(bm_mul(fp16_to_fp32(w->d), fp16_to_fp32(x->d)), static_cast<float>(bm_isum32(w, x->qs)));
}
SHARPI_HD inline float bm_dot_q8(const block_q8_0* w, const block_q8_0* x) {
    return bm_mul(bm_mul(fp16_to_fp32(w->d), fp16_to_fp32(x->d)), static_cast<float>(bm_isum32(w, x->qs)));
}
SHARPI_HD inline float bm_dot_q8(const block_q4_1* w, const block_q8_1* x) {
    const float scaled =
        bm_mul(bm_mul(fp16_to_fp32(w->d), fp16_to_fp32(x->d)), static_cast<float>(bm_isum32(w, x->qs)));
    return bm_add(scaled, bm_mul(fp16_to_fp32(w->m), fp16_to_fp32(x->s)));
}
SHARPI_HD inline float bm_dot_q8(const block_q5_1* w, const block_q8_1* x) {
    const float scaled =
        bm_mul(bm_mul(fp16_to_fp32(w->d), fp16_to_fp32(x->d)), static_cast<float>(bm_isum32(w, x->qs)));
    return bm_add(scaled, bm_mul(fp16_to_fp32(w->m), fp16_to_fp32(x->s)));
}

// K-quants as w = d * sc[s] * u - dmin * mn[s] per 16-element sub-block s (the offsets of Q3_K /
// Q6_K folded into a signed u): isum = sum_s sc[s] * sum_{i in s} u_i * q_i (exact int32),
// imin = sum_s mn[s] * bsums[s].
SHARPI_HD inline float bm_k_combine(float dx, float d, float dmin, int isum, int imin) {
    return bm_sub(bm_mul(bm_mul(dx, d), static_cast<float>(isum)),
                  bm_mul(bm_mul(dx, dmin), static_cast<float>(imin)));
}

SHARPI_HD inline float bm_dot_q8(const block_q2_K* w, const block_q8_K* x) {
    int isum = 0, imin = 0;
    for (int s = 0; s < 16; ++s) {
        int sub = 0;
        for (int i = 0; i < 16; ++i) sub += bm_q2_bits(w->qs, 16 * s + i) * x->qs[16 * s + i];
        isum += (w->scales[s] & 0x0F) * sub;
        imin += (w->scales[s] >> 4) * x->bsums[s];
    }
    return bm_k_combine(x->d, fp16_to_fp32(w->d), fp16_to_fp32(w->dmin), isum, imin);
}
SHARPI_HD inline float bm_dot_q8(const block_q3_K* w, const block_q8_K* x) {
    int isum = 0;
    for (int s = 0; s < 16; ++s) {
        int sub = 0;
        for (int i = 0; i < 16; ++i) sub += bm_q3_K_quant(w, 16 * s + i) * x->qs[16 * s + i];
        isum += bm_q3_K_scale(w->scales, s) * sub;
    }
    return bm_k_combine(x->d, fp16_to_fp32(w->d), 0.0f, isum, 0);
}
SHARPI_HD inline float bm_dot_q8(const block_q4_K* w, const block_q8_K* x) {
    int isum = 0, imin = 0;
    for (int s = 0; s < 16; ++s) {
        int sc, m, sub = 0;
        bm_q4_K_scale_min(w->scales, s / 2, sc, m);
        for (int i = 0; i < 16; ++i) sub += bm_q4_K_quant(w->qs, 16 * s + i) * x->qs[16 * s + i];
        isum += sc * sub;
        imin += m * x->bsums[s];
    }
    return bm_k_combine(x->d, fp16_to_fp32(w->d), fp16_to_fp32(w->dmin), isum, imin);
}
SHARPI_HD inline float bm_dot_q8(const block_q5_K* w, const block_q8_K* x) {
    int isum = 0, imin = 0;
    for (int s = 0; s < 16; ++s) {
        int sc, m, sub = 0;
        bm_q4_K_scale_min(w->scales, s / 2, sc, m);
        for (int i = 0; i < 16; ++i) sub += bm_q5_K_quant(w, 16 * s + i) * x->qs[16 * s + i];
        isum += sc * sub;
        imin += m * x->bsums[s];
    }
    return bm_k_combine(x->d, fp16_to_fp32(w->d), fp16_to_fp32(w->dmin), isum, imin);
}
SHARPI_HD inline float bm_dot_q8(const block_q6_K* w, const block_q8_K* x) {
    int isum = 0;
    for (int s = 0; s < 16; ++s) {
        int sub = 0;
        for (int i = 0; i < 16; ++i) sub += bm_q6_K_quant(w, 16 * s + i) * x->qs[16 * s + i];
        isum += w->scales[s] * sub;
    }
    return bm_k_combine(x->d, fp16_to_fp32(w->d), 0.0f, isum, 0);
}

// The activation block each weight block is dotted with.
template <typename Block>
struct BmActBlock;
template <>
struct BmActBlock<block_q4_0> {
    using type = block_q8_0;
};
template <>
struct BmActBlock<block_q5_0> {
    using type = block_q8_0;
};
template <>
struct BmActBlock<block_q8_0> {
    using type = block_q8_0;
};
template <>
struct BmActBlock<block_q4_1> {
    using type = block_q8_1;
};
template <>
struct BmActBlock<block_q5_1> {
    using type = block_q8_1;
};
template <>
struct BmActBlock<block_q2_K> {
    using type = block_q8_K;
};
template <>
struct BmActBlock<block_q3_K> {
    using type = block_q8_K;
};
template <>
struct BmActBlock<block_q4_K> {
    using type = block_q8_K;
};
template <>
struct BmActBlock<block_q5_K> {
    using type = block_q8_K;
};
template <>
struct BmActBlock<block_q6_K> {
    using type = block_q8_K;
};

SHARPI_HD inline void bm_quantize(const float* x, block_q8_0* y) {
    bm_quantize_q8_0(x, y);
}
SHARPI_HD inline void bm_quantize(const float* x, block_q8_1* y) {
    bm_quantize_q8_1(x, y);
}
SHARPI_HD inline void bm_quantize(const float* x, block_q8_K* y) {
    bm_quantize_q8_K(x, y);
}

// Calls f(static_cast<const Block*>(nullptr)) with the block struct of `type` (bm_f32 / bm_f16 /
// bm_bf16 for the plain types); false for a type without block math (nothing called).
template <typename F>
bool bm_dispatch(GgmlType type, F&& f) {
    switch (type) {
        case GgmlType::F32:
            f(static_cast<const bm_f32*>(nullptr));
            return true;
        case GgmlType::F16:
            f(static_cast<const bm_f16*>(nullptr));
            return true;
        case GgmlType::BF16:
            f(static_cast<const bm_bf16*>(nullptr));
            return true;
        case GgmlType::Q4_0:
            f(static_cast<const block_q4_0*>(nullptr));
            return true;
        case GgmlType::Q4_1:
            f(static_cast<const block_q4_1*>(nullptr));
            return true;
        case GgmlType::Q5_0:
            f(static_cast<const block_q5_0*>(nullptr));
            return true;
        case GgmlType::Q5_1:
            f(static_cast<const block_q5_1*>(nullptr));
            return true;
        case GgmlType::Q8_0:
            f(static_cast<const block_q8_0*>(nullptr));
            return true;
        case GgmlType::Q2_K:
            f(static_cast<const block_q2_K*>(nullptr));
            return true;
        case GgmlType::Q3_K:
            f(static_cast<const block_q3_K*>(nullptr));
            return true;
        case GgmlType::Q4_K:
            f(static_cast<const block_q4_K*>(nullptr));
            return true;
        case GgmlType::Q5_K:
            f(static_cast<const block_q5_K*>(nullptr));
            return true;
        case GgmlType::Q6_K:
            f(static_cast<const block_q6_K*>(nullptr));
            return true;
        default:
            return false;
    }
}

// True for the types with an int8 path (every quantized type; the plain ones stay f32).
template <typename Block>
constexpr bool bm_has_int8() {
    return BmBlockSize<Block>::value > 1;
}

}  // namespace sharpi::cuda
