// Private to cpu/ops/attention: the per-ISA vector kernels the attention loop uses beside the quant
// row kernels (cpu/quant/kernels.h supplies the K dot and the V row decode for every stored type).
// One scalar reference (attention_scalar.cpp) and AVX2 / AVX-512 versions (attention_avx2.cpp,
// attention_avx512.cpp, compiled with those flags), chosen with the quant kernels' ISA
// (cpu::active_isa(), dispatch.cpp): the SIMD tables are touched only when CPUID allows them.
//
// ODR rule as in cpu/quant/kernels_impl.h: the SIMD files use only intrinsics and their own
// file-local functions.
#pragma once

#include <cstdint>

#include "cpu/quant/kernels.h"

namespace sharpi::cpu::detail {

struct AttentionVecKernels {
    void (*axpy)(float a, const float* x, float* y, int64_t n);  // y[i] += a * x[i]
    void (*scale)(float a, float* y, int64_t n);                 // y[i] *= a
};

const AttentionVecKernels& attention_vec_scalar();
const AttentionVecKernels& attention_vec_avx2();    // only when detect_isa() >= Isa::avx2
const AttentionVecKernels& attention_vec_avx512();  // only when detect_isa() == Isa::avx512

}  // namespace sharpi::cpu::detail
