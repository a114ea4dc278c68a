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
