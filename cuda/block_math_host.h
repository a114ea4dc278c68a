// Host entries to the block math of block_math.cuh, compiled by the host compiler in every build
// (CUDA or not), so the host test suite checks the arithmetic the device kernels run (exposed as
// sharpi._core.cuda_block_math_*). Rows are whole blocks of the type; sizes are checked and bad
// input is an InvalidArgument / UnsupportedError naming the type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "quant/ggml_type.h"

namespace sharpi::cuda {

// True when block_math.cuh implements `type` (the device kernels take it).
bool host_has_block_math(GgmlType type);

// data: n_bytes of `type` blocks -> every element as f32 (bm_dequant, element by element).
std::vector<float> host_dequantize(GgmlType type, const void* data, size_t n_bytes);

// x[n] quantized to the activation blocks (q8_0 / q8_1 / q8_K) the int8 path pairs with `weight`.
std::vector<uint8_t> host_quantize_act(GgmlType weight, const float* x, int64_t n);

// One f32 partial per block: bm_dot_q8(w block b, activation block b). w holds n_bytes of
// `weight` blocks, xq the activation blocks of the same number of elements.
std::vector<float> host_dot_q8_blocks(GgmlType weight, const void* w, size_t w_bytes, const void* xq,
                                      size_t xq_bytes);

}  // namespace sharpi::cuda
