// Quantized matrix-matrix product for prefill (int8 path): Y[t, r] = W[r] . Xq[t] for a batch of
// tokens, the activations already quantized per token (launch_quantize_act). Each thread block
// takes kTileRows weight rows x kTileTokens tokens; the tokens' activation blocks are staged in
// shared memory a chunk at a time, so each weight block is read from global memory once per tile
// of tokens instead of once per token. Every (row, token) sums the same block partials
// (bm_dot_q8) as launch_matvec_q8, in lane-strided order then a warp reduction; the order is the
// same as the matvec's, so prefill and decode give the same bits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "quant/ggml_type.h"

namespace sharpi::cuda {

void launch_matmul_q8(GgmlType type, const void* w, int64_t n_rows, int64_t n_cols, const void* xq,
                      int64_t n_tokens, float* y, cudaStream_t stream);

}  // namespace sharpi::cuda
