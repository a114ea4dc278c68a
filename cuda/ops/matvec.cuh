// Matrix-vector (and small matrix-matrix) products with quantized weights, the weights read in
// their file layout. W: [n_rows, n_cols] of `type` (row-major, rows of whole blocks); x: n_tokens
// rows of n_cols; y: n_tokens rows of n_rows (y[t * n_rows + r] = W[r] . x[t]).
//
// Exact path (launch_matvec_f32): f32 activations, each weight element dequantized with the block
// math (bit-identical to the CPU's dequantize) and the products summed in f32 per warp; the sum
// order differs from the CPU's, so results agree to f32 rounding, not bitwise.
// Int8 path: x is first quantized per token (launch_quantize_act: the q8_0 / q8_1 / q8_K blocks the
// CPU fast mode builds, same bytes), then launch_matvec_q8 sums bm_dot_q8 block partials per row.
// Plain F32 / F16 / BF16 weights have no int8 path: callers use the exact path for them in both
// modes (as the CPU does).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "quant/ggml_type.h"

namespace sharpi::cuda {

void launch_matvec_f32(GgmlType type, const void* w, int64_t n_rows, int64_t n_cols, const float* x,
                       int64_t n_tokens, float* y, cudaStream_t stream);

// Bytes of one token's quantized activations (n_cols elements) for weights of `type`; 0 when the
// type has no int8 path.
size_t q8_act_row_bytes(GgmlType type, int64_t n_cols);
// x: n_tokens rows of n_cols -> xq: n_tokens rows of q8_act_row_bytes(type, n_cols).
void launch_quantize_act(GgmlType type, const float* x, int64_t n_cols, int64_t n_tokens, void* xq,
                         cudaStream_t stream);
void launch_matvec_q8(GgmlType type, const void* w, int64_t n_rows, int64_t n_cols, const void* xq,
                      int64_t n_tokens, float* y, cudaStream_t stream);

// A linear layer's product for n_tokens rows of x: int8 = true and a type with an int8 path
// quantizes x into xq (n_tokens rows of q8_act_row_bytes(type, n_cols)) and runs the matvec (one
// token) or the tiled matmul (several: the same bits per row); otherwise the exact f32 matvec.
void launch_linear(GgmlType type, const void* w, int64_t n_rows, int64_t n_cols, const float* x,
                   int64_t n_tokens, bool int8, void* xq, float* y, cudaStream_t stream);

}  // namespace sharpi::cuda
