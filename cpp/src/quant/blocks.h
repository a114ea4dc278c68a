// GGUF quantization block layouts, byte-for-byte as ggml writes them. Shared by the CPU kernels
// and the CUDA kernels (plain structs, no C++ beyond what nvcc accepts in device code).
//
// Every block stores its scales as IEEE half (ggml_half: the raw 16 bits) so that the layout is
// exact; convert with fp16_to_fp32 from quant/fp16.h. A row of n elements is n / block_size
// consecutive blocks; rows of a tensor are consecutive.
#pragma once

#include <stdint.h>

namespace sharpi {

typedef uint16_t ggml_half;

#define QK4_0 32
#define QK4_1 32
#define QK5_0 32
#define QK5_1 32
#define QK8_0 32
#define QK_K 256
#define K_SCALE_SIZE 12

// x = d * (q - 8), q in [0, 15]; element j of the block is low nibble of qs[j] (j < 16) or the
// high nibble of qs[j - 16].
struct block_q4_0 {
    ggml_half d;
    uint8_t qs[QK4_0 / 2];
};
static_assert(sizeof(block_q4_0) == 2 + QK4_0 / 2, "wrong q4_0 block size");

// x = d * q + m
struct block_q4_1 {
    ggml_half d;
    ggml_half m;
    uint8_t qs[QK4_1 / 2];
};
static_assert(sizeof(block_q4_1) == 4 + QK4_1 / 2, "wrong q4_1 block size");

// x = d * (q - 16), q = nibble | (bit j of qh) << 4, qh little-endian 32 bits
struct block_q5_0 {
    ggml_half d;
    uint8_t qh[4];
    uint8_t qs[QK5_0 / 2];
};
static_assert(sizeof(block_q5_0) == 2 + 4 + QK5_0 / 2, "wrong q5_0 block size");

// x = d * q + m
struct block_q5_1 {
    ggml_half d;
    ggml_half m;
    uint8_t qh[4];
    uint8_t qs[QK5_1 / 2];
};
static_assert(sizeof(block_q5_1) == 4 + 4 + QK5_1 / 2, "wrong q5_1 block size");

// x = d * q
struct block_q8_0 {
    ggml_half d;
    int8_t qs[QK8_0];
};
static_assert(sizeof(block_q8_0) == 2 + QK8_0, "wrong q8_0 block size");

// 16 sub-blocks of 16: x = d * (scales[i] & 0xF) * q - dmin * (scales[i] >> 4)
struct block_q2_K {
    uint8_t scales[QK_K / 16];
    uint8_t qs[QK_K / 4];
    ggml_half d;
    ggml_half dmin;
};
static_assert(sizeof(block_q2_K) == QK_K / 16 + QK_K / 4 + 4, "wrong q2_K block size");

// 16 sub-blocks of 16, 6-bit signed scales packed in 12 bytes; q = low 2 bits | high bit from hmask,
// x = d * (scale - 32) * (q - 4 if the hmask bit is clear else q)
struct block_q3_K {
    uint8_t hmask[QK_K / 8];
    uint8_t qs[QK_K / 4];
    uint8_t scales[12];
    ggml_half d;
};
static_assert(sizeof(block_q3_K) == QK_K / 8 + QK_K / 4 + 12 + 2, "wrong q3_K block size");

// 8 sub-blocks of 32, 6-bit scales and mins packed in 12 bytes: x = d * sc * q - dmin * m
struct block_q4_K {
    ggml_half d;
    ggml_half dmin;
    uint8_t scales[K_SCALE_SIZE];
    uint8_t qs[QK_K / 2];
};
static_assert(sizeof(block_q4_K) == 4 + K_SCALE_SIZE + QK_K / 2, "wrong q4_K block size");

// as q4_K with a fifth bit per element in qh
struct block_q5_K {
    ggml_half d;
    ggml_half dmin;
    uint8_t scales[K_SCALE_SIZE];
    uint8_t qh[QK_K / 8];
    uint8_t qs[QK_K / 2];
};
static_assert(sizeof(block_q5_K) == 4 + K_SCALE_SIZE + QK_K / 8 + QK_K / 2, "wrong q5_K block size");

// 16 sub-blocks of 16, int8 scales: x = d * scales[i] * (q - 32), q = 4 low bits (ql) | 2 high (qh)
struct block_q6_K {
    uint8_t ql[QK_K / 2];
    uint8_t qh[QK_K / 4];
    int8_t scales[QK_K / 16];
    ggml_half d;
};
static_assert(sizeof(block_q6_K) == QK_K / 2 + QK_K / 4 + QK_K / 16 + 2, "wrong q6_K block size");

// MXFP4 (OCP microscaling, gpt-oss experts): 32 e2m1 values sharing one E8M0 exponent byte.
// x = 2^(e - 128) * kMxfp4Values[nibble]: the table holds the e2m1 values doubled (so they are
// integers) and the scale is halved to match, as ggml's GGML_E8M0_TO_FP32_HALF. Element j is the
// low nibble of qs[j] (j < 16) or the high nibble of qs[j - 16], as Q4_0. Fast mode pairs it with
// q8_0 activations (the nibble values are small signed integers, like Q4_0's).
#define QK_MXFP4 32
struct block_mxfp4 {
    uint8_t e;
    uint8_t qs[QK_MXFP4 / 2];
};
static_assert(sizeof(block_mxfp4) == 1 + QK_MXFP4 / 2, "wrong mxfp4 block size");
// ---- IQ types (importance-matrix quants) -------------------------------------------------------
//
// Each value is (f16 d) * (small integer scale) * (a table value, quant/iq_tables.h) * (sign), every
// product exact in f32. Element e of a 256-block lies in sub-block e / 32; "entry" k of a grid type
// covers elements [8k, 8k + 8) (IQ3: [4k, 4k + 4)). The decoders are in cpu/quant/iq_unpack.h.

#define QK4_NL 32

// x = d * kIq4nlValues[q]; element j < 16 is the low nibble of qs[j], 16 + j the high nibble.
struct block_iq4_nl {
    ggml_half d;
    uint8_t qs[QK4_NL / 2];
};
static_assert(sizeof(block_iq4_nl) == 2 + QK4_NL / 2, "wrong iq4_nl block size");

// 8 sub-blocks of 32 as IQ4_NL blocks, with 6-bit scales ls (low 4 bits in scales_l nibbles, high 2
// in scales_h): x = d * (ls - 32) * kIq4nlValues[q].
struct block_iq4_xs {
    ggml_half d;
    uint16_t scales_h;
    uint8_t scales_l[QK_K / 64];
    uint8_t qs[QK_K / 2];
};
static_assert(sizeof(block_iq4_xs) == 4 + QK_K / 64 + QK_K / 2, "wrong iq4_xs block size");

// Per sub-block two uint32: 4 grid indices (bytes), then 4 x 7 sign bits and a 4-bit scale ls:
// x = d * (ls + 1/2) / 4 * kIq2xxsGrid * sign.
struct block_iq2_xxs {
    ggml_half d;
    uint16_t qs[QK_K / 8];
};
static_assert(sizeof(block_iq2_xxs) == 2 + QK_K / 4, "wrong iq2_xxs block size");

// qs[k]: 9-bit grid index and 7 sign bits; one 4-bit scale per 16 elements.
struct block_iq2_xs {
    ggml_half d;
    uint16_t qs[QK_K / 8];
    uint8_t scales[QK_K / 32];
};
static_assert(sizeof(block_iq2_xs) == 2 + QK_K / 4 + QK_K / 32, "wrong iq2_xs block size");

// qs[0..32): low 8 bits of the 10-bit grid indices, qs[32..64): 8 explicit sign bits per entry,
// qh: the indices' top 2 bits; one 4-bit scale per 16 elements.
struct block_iq2_s {
    ggml_half d;
    uint8_t qs[QK_K / 4];
    uint8_t qh[QK_K / 32];
    uint8_t scales[QK_K / 32];
};
static_assert(sizeof(block_iq2_s) == 2 + QK_K / 4 + QK_K / 16, "wrong iq2_s block size");

// qs[0..64): grid indices (4 values each); qs[64..96): per sub-block a uint32 of 4 x 7 sign bits
// and a 4-bit scale ls: x = d * (ls + 1/2) / 2 * kIq3xxsGrid * sign.
struct block_iq3_xxs {
    ggml_half d;
    uint8_t qs[3 * QK_K / 8];
};
static_assert(sizeof(block_iq3_xxs) == 2 + 3 * QK_K / 8, "wrong iq3_xxs block size");

// 9-bit grid indices (qs low 8, qh bit 8), explicit sign bits, one 4-bit scale per sub-block:
// x = d * (1 + 2 ls) * kIq3sGrid * sign.
struct block_iq3_s {
    ggml_half d;
    uint8_t qs[QK_K / 4];
    uint8_t qh[QK_K / 32];
    uint8_t signs[QK_K / 8];
    uint8_t scales[QK_K / 64];
};
static_assert(sizeof(block_iq3_s) == 2 + 13 * (QK_K / 32) + QK_K / 64, "wrong iq3_s block size");

// 11-bit indices into kIq1sGrid (qs low 8, qh 3 bits per entry); qh[sub-block] also holds a 3-bit
// scale (bits 12-14) and the sign of a +-1/8 shift (bit 15): x = d * (2 ls + 1) * (grid + delta).
struct block_iq1_s {
    ggml_half d;
    uint8_t qs[QK_K / 8];
    uint16_t qh[QK_K / 32];
};
static_assert(sizeof(block_iq1_s) == 2 + QK_K / 8 + QK_K / 16, "wrong iq1_s block size");

// As IQ1_S with a 3-bit scale per 16 elements and the delta sign per entry (qh nibble bit 3); the
// f16 d is spread over the top nibbles of the four uint16 scale words.
struct block_iq1_m {
    uint8_t qs[QK_K / 8];
    uint8_t qh[QK_K / 16];
    uint8_t scales[QK_K / 32];
};
static_assert(sizeof(block_iq1_m) == QK_K / 8 + QK_K / 16 + QK_K / 32, "wrong iq1_m block size");

// ---- activation blocks (fast mode: a row of activations quantized once per matmul) ---------------
//
// Weights of Q4_0 / Q5_0 / Q8_0 are dotted with activations in block_q8_0 (above; f16 scale, as
// llama.cpp), Q4_1 / Q5_1 with block_q8_1 (f16 scale and f16 s = d * sum(qs), for the weight's
// min term), every K-quant with block_q8_K (f32 scale, and bsums[i] = sum of qs[16i .. 16i + 15]
// for the K-quants' mins and offsets). In every one x ~= d * qs with qs in [-127, 127].
struct block_q8_1 {
    ggml_half d;
    ggml_half s;
    int8_t qs[QK8_0];
};
static_assert(sizeof(block_q8_1) == 4 + QK8_0, "wrong q8_1 block size");

struct block_q8_K {
    float d;
    int8_t qs[QK_K];
    int16_t bsums[QK_K / 16];
};
static_assert(sizeof(block_q8_K) == 4 + QK_K + QK_K / 8, "wrong q8_K block size");

}  // namespace sharpi
