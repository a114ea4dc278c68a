// Scalar reference kernels: portable C++ for any x86-64 (or other) CPU, and the readable statement
// of what every SIMD kernel computes.
//
// Dequantization follows ggml's dequantize_row_* element order, and rounds exactly like the gguf
// package's numpy dequantize (the test oracle): each formula below is evaluated in f32 with one
// rounding per operation, in the order written, so the values match numpy bit for bit. The SIMD
// files build the same values the same way.
//
// Accumulation layout of this ISA (LaneSums): 8 f32 partial sums, element i of the row goes to
// sum i % 8 (w[i] * x[i] rounded, then added, no FMA), and the 8 sums are combined in one fixed
// tree. dot_f32 and every dot_row feed LaneSums in element order, dot_row from a small buffer
// filled by the very same block dequantizer that dequant_row uses, so
// dot_row(w, x) == dot_f32(dequant_row(w), x) bit for bit by construction.
#include <string.h>

#include "cpu/quant/iq_unpack.h"
#include "cpu/quant/kernels_impl.h"
#include "quant/fp16.h"

namespace sharpi::cpu::detail {
namespace {

constexpr int kLanes = 8;

class LaneSums {
  public:
    // Adds w[i] * x[i] for i in [0, count), continuing the element order of earlier calls.
    void add(const float* w, const float* x, int64_t count) {
        int64_t i = 0;
        for (; i < count && next_lane_ != 0; ++i) add_one(w[i], x[i]);
        for (; i + kLanes <= count; i += kLanes) {
            for (int l = 0; l < kLanes; ++l) lane_[l] += w[i + l] * x[i + l];
        }
        for (; i < count; ++i) add_one(w[i], x[i]);
    }

    float total() const {
        return ((lane_[0] + lane_[1]) + (lane_[2] + lane_[3])) +
               ((lane_[4] + lane_[5]) + (lane_[6] + lane_[7]));
    }

  private:
    void add_one(float w, float x) {
        lane_[next_lane_] += w * x;
        next_lane_ = (next_lane_ + 1) % kLanes;
    }

    float lane_[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
    int next_lane_ = 0;
};

float dot_f32_scalar(const float* a, const float* b, int64_t n) {
    LaneSums sums;
    sums.add(a, b, n);
    return sums.total();
}

// The reference tile is the definition: one dot_f32 per (row, token).
void dot_f32_tile_scalar(const float* w, int64_t ldw, int64_t n_rows, const float* x, int64_t ldx,
                         int64_t n_tokens, int64_t n, float* y, int64_t ldy) {
    for (int64_t t = 0; t < n_tokens; ++t) {
        for (int64_t r = 0; r < n_rows; ++r) y[t * ldy + r] = dot_f32_scalar(w + r * ldw, x + t * ldx, n);
    }
}

// ---- block dequantizers: one block in, block_size floats out ------------------------------------

void dequant_block_q4_0(const block_q4_0* b, float* y) {
    const float d = fp16_to_fp32(b->d);
    for (int j = 0; j < QK4_0 / 2; ++j) {
        y[j] = d * static_cast<float>((b->qs[j] & 0x0F) - 8);
        y[j + QK4_0 / 2] = d * static_cast<float>((b->qs[j] >> 4) - 8);
    }
}

void dequant_block_mxfp4(const block_mxfp4* b, float* y) {
    const float d = mxfp4_scale(b->e);
    for (int j = 0; j < QK_MXFP4 / 2; ++j) {
        y[j] = d * static_cast<float>(kMxfp4Values[b->qs[j] & 0x0F]);
        y[j + QK_MXFP4 / 2] = d * static_cast<float>(kMxfp4Values[b->qs[j] >> 4]);
    }
}

void dequant_block_q4_1(const block_q4_1* b, float* y) {
    const float d = fp16_to_fp32(b->d);
    const float m = fp16_to_fp32(b->m);
    for (int j = 0; j < QK4_1 / 2; ++j) {
        y[j] = d * static_cast<float>(b->qs[j] & 0x0F) + m;
        y[j + QK4_1 / 2] = d * static_cast<float>(b->qs[j] >> 4) + m;
    }
}

// The 32 high bits of a Q5 block, bit j for element j, stored little-endian.
uint32_t q5_high_bits(const uint8_t qh[4]) {
    return static_cast<uint32_t>(qh[0]) | static_cast<uint32_t>(qh[1]) << 8 |
           static_cast<uint32_t>(qh[2]) << 16 | static_cast<uint32_t>(qh[3]) << 24;
}

void dequant_block_q5_0(const block_q5_0* b, float* y) {
    const float d = fp16_to_fp32(b->d);
    const uint32_t qh = q5_high_bits(b->qh);
    for (int j = 0; j < QK5_0 / 2; ++j) {
        const int q_lo = (b->qs[j] & 0x0F) | static_cast<int>((qh >> j) & 1u) << 4;
        const int q_hi = (b->qs[j] >> 4) | static_cast<int>((qh >> (j + 16)) & 1u) << 4;
        y[j] = d * static_cast<float>(q_lo - 16);
        y[j + QK5_0 / 2] = d * static_cast<float>(q_hi - 16);
    }
}

void dequant_block_q5_1(const block_q5_1* b, float* y) {
    const float d = fp16_to_fp32(b->d);
    const float m = fp16_to_fp32(b->m);
    const uint32_t qh = q5_high_bits(b->qh);
    for (int j = 0; j < QK5_1 / 2; ++j) {
        const int q_lo = (b->qs[j] & 0x0F) | static_cast<int>((qh >> j) & 1u) << 4;
        const int q_hi = (b->qs[j] >> 4) | static_cast<int>((qh >> (j + 16)) & 1u) << 4;
        y[j] = d * static_cast<float>(q_lo) + m;
        y[j + QK5_1 / 2] = d * static_cast<float>(q_hi) + m;
    }
}

void dequant_block_q8_0(const block_q8_0* b, float* y) {
    const float d = fp16_to_fp32(b->d);
    for (int j = 0; j < QK8_0; ++j) y[j] = static_cast<float>(b->qs[j]) * d;
}

// Q2_K: element 128h + 32j + 16l + i (h < 2, j < 4, l < 2, i < 16) is 2 bits of
// qs[32h + 16l + i] at bit 2j, in sub-block 8h + 2j + l.
void dequant_block_q2_K(const block_q2_K* b, float* y) {
    const float d = fp16_to_fp32(b->d);
    const float dmin = fp16_to_fp32(b->dmin);
    for (int h = 0; h < 2; ++h) {
        for (int j = 0; j < 4; ++j) {
            for (int l = 0; l < 2; ++l) {
                const int sub = 8 * h + 2 * j + l;
                const float dl = d * static_cast<float>(b->scales[sub] & 0x0F);
                const float ml = dmin * static_cast<float>(b->scales[sub] >> 4);
                const uint8_t* q = b->qs + 32 * h + 16 * l;
                float* out = y + 16 * sub;
                for (int i = 0; i < 16; ++i) out[i] = dl * static_cast<float>((q[i] >> (2 * j)) & 3) - ml;
            }
        }
    }
}

// Q3_K: element 128h + 32j + 16l + i has low 2 bits from qs[32h + 16l + i] at bit 2j and its
// high bit from hmask[16l + i] at bit 4h + j; q = low - 4 when the high bit is clear, else low.
void dequant_block_q3_K(const block_q3_K* b, float* y) {
    const float d = fp16_to_fp32(b->d);
    uint32_t words[4];
    unpack_q3_K_scales(b->scales, words);
    uint8_t biased[16];
    memcpy(biased, words, 16);
    for (int h = 0; h < 2; ++h) {
        for (int j = 0; j < 4; ++j) {
            for (int l = 0; l < 2; ++l) {
                const int sub = 8 * h + 2 * j + l;
                const float dl = d * static_cast<float>(biased[sub] - 32);
                const uint8_t* q = b->qs + 32 * h + 16 * l;
                const uint8_t* hm = b->hmask + 16 * l;
                float* out = y + 16 * sub;
                for (int i = 0; i < 16; ++i) {
                    const int low = (q[i] >> (2 * j)) & 3;
                    const int high = (hm[i] >> (4 * h + j)) & 1;
                    out[i] = dl * static_cast<float>(low - (high ? 0 : 4));
                }
            }
        }
    }
}

// Q4_K: element 64j + i (i < 32) is the low nibble of qs[32j + i] in sub-block 2j; element
// 64j + 32 + i the high nibble, in sub-block 2j + 1.
void dequant_block_q4_K(const block_q4_K* b, float* y) {
    const float d = fp16_to_fp32(b->d);
    const float dmin = fp16_to_fp32(b->dmin);
    uint8_t sc[8], m[8];
    const Q4KScaleWords words = unpack_q4_K_scale_min(b->scales);
    memcpy(sc, &words.sc_lo, 4);
    memcpy(sc + 4, &words.sc_hi, 4);
    memcpy(m, &words.m_lo, 4);
    memcpy(m + 4, &words.m_hi, 4);
    for (int j = 0; j < 4; ++j) {
        const float d_lo = d * static_cast<float>(sc[2 * j]), m_lo = dmin * static_cast<float>(m[2 * j]);
        const float d_hi = d * static_cast<float>(sc[2 * j + 1]),
                    m_hi = dmin * static_cast<float>(m[2 * j + 1]);
        const uint8_t* q = b->qs + 32 * j;
        for (int i = 0; i < 32; ++i) {
            y[64 * j + i] = d_lo * static_cast<float>(q[i] & 0x0F) - m_lo;
            y[64 * j + 32 + i] = d_hi * static_cast<float>(q[i] >> 4) - m_hi;
        }
    }
}

// Q5_K: as Q4_K, plus a fifth bit from qh[i] at bit 2j (low nibbles) or 2j + 1 (high nibbles).
void dequant_block_q5_K(const block_q5_K* b, float* y) {
    const float d = fp16_to_fp32(b->d);
    const float dmin = fp16_to_fp32(b->dmin);
    uint8_t sc[8], m[8];
    const Q4KScaleWords words = unpack_q4_K_scale_min(b->scales);
    memcpy(sc, &words.sc_lo, 4);
    memcpy(sc + 4, &words.sc_hi, 4);
    memcpy(m, &words.m_lo, 4);
    memcpy(m + 4, &words.m_hi, 4);
    for (int j = 0; j < 4; ++j) {
        const float d_lo = d * static_cast<float>(sc[2 * j]), m_lo = dmin * static_cast<float>(m[2 * j]);
        const float d_hi = d * static_cast<float>(sc[2 * j + 1]),
                    m_hi = dmin * static_cast<float>(m[2 * j + 1]);
        const uint8_t* q = b->qs + 32 * j;
        for (int i = 0; i < 32; ++i) {
            const int q_lo = (q[i] & 0x0F) | ((b->qh[i] >> (2 * j)) & 1) << 4;
            const int q_hi = (q[i] >> 4) | ((b->qh[i] >> (2 * j + 1)) & 1) << 4;
            y[64 * j + i] = d_lo * static_cast<float>(q_lo) - m_lo;
            y[64 * j + 32 + i] = d_hi * static_cast<float>(q_hi) - m_hi;
        }
    }
}

// Q6_K: within half h (128 elements), element 32k + i (k < 4, i < 32) has its low 4 bits in
// ql[64h + 32(k % 2) + i] (low nibble for k < 2, high nibble for k >= 2) and its high 2 bits in
// qh[32h + i] at bit 2k; q - 32 is scaled by scales[e / 16] for element e of the block.
void dequant_block_q6_K(const block_q6_K* b, float* y) {
    const float d = fp16_to_fp32(b->d);
    for (int h = 0; h < 2; ++h) {
        const uint8_t* ql = b->ql + 64 * h;
        const uint8_t* qh = b->qh + 32 * h;
        for (int k = 0; k < 4; ++k) {
            for (int i = 0; i < 32; ++i) {
                const int e = 128 * h + 32 * k + i;
                const int low = (k < 2) ? (ql[32 * (k % 2) + i] & 0x0F) : (ql[32 * (k % 2) + i] >> 4);
                const int high = (qh[i] >> (2 * k)) & 3;
                const float dl = d * static_cast<float>(b->scales[e / 16]);
                y[e] = dl * static_cast<float>((low | high << 4) - 32);
            }
        }
    }
}

// IQ types: unpacked to integers (iq_unpack.h), then (d * sc) * q, every product exact.
void dequant_block_iq4_nl(const block_iq4_nl* b, float* y) {
    const float d = fp16_to_fp32(b->d);
    int8_t q[QK4_NL];
    unpack_iq4_nl(b, q);
    for (int j = 0; j < QK4_NL; ++j) y[j] = d * static_cast<float>(q[j]);
}

template <typename Block, void (*Unpack)(const Block*, IqUnpacked&)>
void dequant_block_iq(const Block* b, float* y) {
    IqUnpacked u;
    Unpack(b, u);
    for (int e = 0; e < QK_K; ++e)
        y[e] = (u.d * static_cast<float>(u.sc[e / 16])) * static_cast<float>(u.q[e]);
}

// ---- rows -----------------------------------------------------------------------------------------

// Row kernels for a block type: dequant_row runs the block dequantizer over the row; dot_row
// dequantizes one block at a time into a stack buffer and feeds LaneSums in element order.
template <typename Block, int kBlockSize, void (*DequantBlock)(const Block*, float*)>
struct BlockRow {
    static void dequant_row(const void* src, float* dst, int64_t n) {
        const Block* blocks = static_cast<const Block*>(src);
        for (int64_t ib = 0; ib < n / kBlockSize; ++ib) DequantBlock(blocks + ib, dst + ib * kBlockSize);
    }

    static float dot_row(const void* src, const float* x, int64_t n) {
        const Block* blocks = static_cast<const Block*>(src);
        float buf[kBlockSize];
        LaneSums sums;
        for (int64_t ib = 0; ib < n / kBlockSize; ++ib) {
            DequantBlock(blocks + ib, buf);
            sums.add(buf, x + ib * kBlockSize, kBlockSize);
        }
        return sums.total();
    }
};

void dequant_row_f32(const void* src, float* dst, int64_t n) {
    memcpy(dst, src, static_cast<size_t>(n) * 4);
}
float dot_row_f32(const void* src, const float* x, int64_t n) {
    return dot_f32_scalar(static_cast<const float*>(src), x, n);
}

// Plain half and bfloat16 rows: exact widening, then the same buffered accumulation.
constexpr int64_t kHalfChunk = 256;

void dequant_row_f16(const void* src, float* dst, int64_t n) {
    const uint16_t* h = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_fp32(h[i]);
}
float dot_row_f16(const void* src, const float* x, int64_t n) {
    const uint16_t* h = static_cast<const uint16_t*>(src);
    float buf[kHalfChunk];
    LaneSums sums;
    for (int64_t i0 = 0; i0 < n; i0 += kHalfChunk) {
        const int64_t count = (n - i0 < kHalfChunk) ? n - i0 : kHalfChunk;
        for (int64_t i = 0; i < count; ++i) buf[i] = fp16_to_fp32(h[i0 + i]);
        sums.add(buf, x + i0, count);
    }
    return sums.total();
}

void dequant_row_bf16(const void* src, float* dst, int64_t n) {
    const uint16_t* h = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_fp32(h[i]);
}
float dot_row_bf16(const void* src, const float* x, int64_t n) {
    const uint16_t* h = static_cast<const uint16_t*>(src);
    float buf[kHalfChunk];
    LaneSums sums;
    for (int64_t i0 = 0; i0 < n; i0 += kHalfChunk) {
        const int64_t count = (n - i0 < kHalfChunk) ? n - i0 : kHalfChunk;
        for (int64_t i = 0; i < count; ++i) buf[i] = bf16_to_fp32(h[i0 + i]);
        sums.add(buf, x + i0, count);
    }
    return sums.total();
}

template <typename Row>
constexpr RowKernels row_entry() {
    return RowKernels{&Row::dequant_row, &Row::dot_row};
}

template <typename Block, void (*Unpack)(const Block*, IqUnpacked&)>
constexpr RowKernels iq_entry() {
    return row_entry<BlockRow<Block, QK_K, dequant_block_iq<Block, Unpack>>>();
}

constexpr IsaKernels make_scalar_table() {
    IsaKernels t{};
    t.by_type[static_cast<int>(GgmlType::F32)] = RowKernels{&dequant_row_f32, &dot_row_f32};
    t.by_type[static_cast<int>(GgmlType::F16)] = RowKernels{&dequant_row_f16, &dot_row_f16};
    t.by_type[static_cast<int>(GgmlType::BF16)] = RowKernels{&dequant_row_bf16, &dot_row_bf16};
    t.by_type[static_cast<int>(GgmlType::Q4_0)] =
        row_entry<BlockRow<block_q4_0, QK4_0, dequant_block_q4_0>>();
    t.by_type[static_cast<int>(GgmlType::Q4_1)] =
        row_entry<BlockRow<block_q4_1, QK4_1, dequant_block_q4_1>>();
    t.by_type[static_cast<int>(GgmlType::Q5_0)] =
        row_entry<BlockRow<block_q5_0, QK5_0, dequant_block_q5_0>>();
    t.by_type[static_cast<int>(GgmlType::Q5_1)] =
        row_entry<BlockRow<block_q5_1, QK5_1, dequant_block_q5_1>>();
    t.by_type[static_cast<int>(GgmlType::Q8_0)] =
        row_entry<BlockRow<block_q8_0, QK8_0, dequant_block_q8_0>>();
    t.by_type[static_cast<int>(GgmlType::Q2_K)] = row_entry<BlockRow<block_q2_K, QK_K, dequant_block_q2_K>>();
    t.by_type[static_cast<int>(GgmlType::Q3_K)] = row_entry<BlockRow<block_q3_K, QK_K, dequant_block_q3_K>>();
    t.by_type[static_cast<int>(GgmlType::Q4_K)] = row_entry<BlockRow<block_q4_K, QK_K, dequant_block_q4_K>>();
    t.by_type[static_cast<int>(GgmlType::Q5_K)] = row_entry<BlockRow<block_q5_K, QK_K, dequant_block_q5_K>>();
    t.by_type[static_cast<int>(GgmlType::Q6_K)] = row_entry<BlockRow<block_q6_K, QK_K, dequant_block_q6_K>>();
    t.by_type[static_cast<int>(GgmlType::MXFP4)] =
        row_entry<BlockRow<block_mxfp4, QK_MXFP4, dequant_block_mxfp4>>();
    t.by_type[static_cast<int>(GgmlType::IQ4_NL)] =
        row_entry<BlockRow<block_iq4_nl, QK4_NL, dequant_block_iq4_nl>>();
    t.by_type[static_cast<int>(GgmlType::IQ4_XS)] = iq_entry<block_iq4_xs, unpack_iq4_xs>();
    t.by_type[static_cast<int>(GgmlType::IQ3_S)] = iq_entry<block_iq3_s, unpack_iq3_s>();
    t.by_type[static_cast<int>(GgmlType::IQ3_XXS)] = iq_entry<block_iq3_xxs, unpack_iq3_xxs>();
    t.by_type[static_cast<int>(GgmlType::IQ2_S)] = iq_entry<block_iq2_s, unpack_iq2_s>();
    t.by_type[static_cast<int>(GgmlType::IQ2_XS)] = iq_entry<block_iq2_xs, unpack_iq2_xs>();
    t.by_type[static_cast<int>(GgmlType::IQ2_XXS)] = iq_entry<block_iq2_xxs, unpack_iq2_xxs>();
    t.by_type[static_cast<int>(GgmlType::IQ1_S)] = iq_entry<block_iq1_s, unpack_iq1_s>();
    t.by_type[static_cast<int>(GgmlType::IQ1_M)] = iq_entry<block_iq1_m, unpack_iq1_m>();
    t.dot_f32 = &dot_f32_scalar;
    t.dot_f32_tile = &dot_f32_tile_scalar;
    return t;
}

constexpr IsaKernels kScalarKernels = make_scalar_table();

}  // namespace

const IsaKernels& scalar_kernels() {
    return kScalarKernels;
}

}  // namespace sharpi::cpu::detail
