// Dequantize rows of any supported type to f32 on the device (exact path; the values equal the
// gguf package's numpy dequantize bit for bit, as the shared block math does on the host).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "quant/ggml_type.h"

namespace sharpi::cuda {

// src: n / block_size blocks of `type`; dst: n floats.
void launch_dequantize(GgmlType type, const void* src, float* dst, int64_t n, cudaStream_t stream);

}  // namespace sharpi::cuda
