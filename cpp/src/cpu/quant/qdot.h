// Fast-mode kernels (docs/design.md §8): the activation row is quantized once per matmul to 8-bit blocks
// and every weight row is dotted with it in integers, as llama.cpp does. Exact mode never calls
// these (kernels.h: f32 activations, dequantized weights).
//
// Formats (quant/blocks.h): K-quant weights (Q2_K..Q6_K) and the 256-element IQ types take q8_K
// activations, Q4_0 / Q5_0 / Q8_0 / IQ4_NL / MXFP4 take q8_0, Q4_1 / Q5_1 take q8_1. F32 / F16 / BF16
// weights have no integer kernel: they keep f32 activations in both modes (their dot_row already widens
// with F16C / shifts).
//
// The arithmetic, identical on every ISA (the tests model it in numpy, bit for bit):
//   quantize a block of activations: amax = max |x|, d = amax / 127, id = 127 / amax (0 when
//     amax == 0), qs = round-half-even(x * id), all in f32; q8_0 / q8_1 store d as f16 (RNE),
//     q8_1's s = f16(f32(sum qs) * d).
//   K-quants: each weight block gives unsigned quants u (0..63), 16 signed sub-block scales sc
//     (one per 16 elements; Q4_K / Q5_K repeat their per-32 scale), optional 16 mins mn, an offset
//     o (Q6_K 32, Q3_K 4, else 0) and f16 d, dmin, so that w = d * sc * (u - o) - dmin * mn. Per block
//       isum = sum_s sc[s] * (sum_{i in s} u_i * q_i) - o * sum_s sc[s] * bsums[s]   (exact int32)
//       imin = sum_s mn[s] * bsums[s]                                                (exact int32)
//       acc = acc + (dx * d) * float(isum);  acc = acc - (dx * dmin) * float(imin)  (if mins)
//     with one f32 rounding per operation, blocks in order, acc starting at 0.
//   256-element IQ types: the same with u = the signed integers q of cpu/quant/iq_unpack.h
//     (|q| <= 127), sc its 16 scales, d its f32 d (f16 d times a power of two), no offset, no min.
//   32-element blocks: weight quants w (signed: Q4_0 u - 8, Q5_0 u - 16, Q8_0, IQ4_NL's table
//     values, MXFP4's table values; unsigned: Q4_1,
//     Q5_1), per block eight exact int32 lane sums L[l] = sum_{i = 4l..4l+3} w_i * q_i, and
//       acc[b % 2][l] = acc[b % 2][l] + (dw * dx) * float(L[l])     (8 lanes, two accumulators)
//       msum[b % 2] = msum[b % 2] + mw * s                           (Q4_1 / Q5_1 only)
//     result = tree(acc[0] + acc[1]) (+ (msum[0] + msum[1])),
//     tree(a) = ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)).
// Integer sums are exact whatever order an ISA forms them in, and the float operations are the
// same sequence on every ISA, so scalar, AVX2 and AVX-512 give the same bits, and a tile of tokens
// gives each token exactly its vec_dot (the invariant prefill == decode rests on it).
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpu/quant/kernels.h"
#include "quant/ggml_type.h"

namespace sharpi::cpu {

enum class ActFormat : int { f32 = 0, q8_0 = 1, q8_1 = 2, q8_K = 3 };

const char* act_format_name(ActFormat format);
// The activation format `weight` rows are dotted with in fast mode (f32: no integer kernel).
ActFormat act_format(GgmlType weight);
int64_t act_block_size(ActFormat format);  // 32, 32, 256; 1 for f32
// Bytes of a quantized activation row of n elements (n a multiple of the block size).
size_t act_row_bytes(ActFormat format, int64_t n);

// Quantizes x[n] (n a multiple of the format's block size) into n / block_size blocks at dst.
using QuantizeActFn = void (*)(const float* x, void* dst, int64_t n);
// One weight row (n elements of its type) . one quantized activation row (n elements).
using VecDotFn = float (*)(const void* w, const void* xq, int64_t n);
// y[t * ldy] = vec_dot(w, xq + t * xq_stride, n) for t < n_tokens (1 .. kMaxTileTokens), bit for
// bit, decoding each weight block once for all the tokens.
using VecDotTileFn = void (*)(const void* w, const void* xq, size_t xq_stride, int n_tokens, int64_t n,
                              float* y, int64_t ldy);
constexpr int kMaxTileTokens = 8;

struct QuantDotKernels {
    VecDotFn vec_dot = nullptr;
    VecDotTileFn vec_dot_tile = nullptr;
};

// Integer kernels of `weight` for `isa`; nullptr when the type has none (F32 / F16 / BF16). On
// Isa::avx512 the AVX-512 VNNI kernels when the CPU has VNNI, else the AVX2 ones (same bits).
const QuantDotKernels* quant_dot_kernels(GgmlType weight, Isa isa);
// Quantizer of a q8 format for `isa` (not for ActFormat::f32).
QuantizeActFn quantize_act_kernel(ActFormat format, Isa isa);

// Prefill on Intel AMX-INT8 tiles (cpu/quant/qdot_amx.cpp): the activation rows are packed in
// tiles of up to kAmxTokens tokens (pack, each into packed_bytes(n) bytes, the tiles consecutive),
// then blocks of up to kAmxRows weight rows are multiplied against all of them (gemm: y[t * ldy +
// r] for r < n_rows, t < n_tokens; a block's quants are unpacked once for every tile), each (row,
// token) bit-identical to vec_dot_tile. Worth it from about half a tile of tokens
// (kAmxMinTokens); fewer go through vec_dot_tile.
constexpr int kAmxTokens = 16;
constexpr int kAmxRows = 16;
constexpr int kAmxMinTokens = 8;
struct AmxKernels {
    size_t (*packed_bytes)(int64_t n);
    void (*pack)(const void* xq, size_t xq_stride, int n_tokens, int64_t n, void* packed);
    void (*gemm)(const void* w, size_t row_bytes, int n_rows, const void* packed, int64_t n_tokens, int64_t n,
                 float* y, int64_t ldy);
};
// The AMX kernels of `weight` (Q4_K so far) on Isa::avx512 when the CPU has AMX-INT8 and AVX-512
// VNNI, the OS grants the process the tile state, and SHARPI_AMX is not 0; else nullptr.
const AmxKernels* amx_kernels(GgmlType weight, Isa isa);
// Whether this process can run the AMX kernels (the conditions above but the type and the ISA).
bool amx_available();

}  // namespace sharpi::cpu
