// Row kernels for every supported GGML type: dequantize a row to f32 and dot a quantized row with
// an f32 vector. One scalar reference per type (kernels_scalar.cpp), fast versions per ISA
// (kernels_avx2.cpp, kernels_avx512.cpp), chosen at run time by CPUID in dispatch.cpp.
//
// These are exact mode's kernels (docs/design.md §8): dot_row computes sum_i dequant(w)_i * x_i in f32,
// activations never quantized. Fast mode's integer kernels (quantized activations) are qdot.h.
//
// Invariant (tested): for one ISA, dot_row(w, x, n) is bit-identical to
// dot_f32(dequant_row(w), x, n), so a prefill (which dequantizes a row once and reuses it for
// every token) and token-by-token decoding produce the same logits bit for bit.
#pragma once

#include <cstdint>

#include "quant/ggml_type.h"

namespace sharpi::cpu {

enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2 };

const char* isa_name(Isa isa);
// "scalar" | "avx2" | "avx512" -> Isa; false for any other spelling. Used for SHARPI_ISA and by
// the bindings' isa= arguments.
bool parse_isa_name(const char* name, Isa* isa);
// The best ISA this CPU supports (CPUID), regardless of any override.
Isa detect_isa();
// detect_isa(), capped by SHARPI_ISA=scalar|avx2|avx512 when set (never above what the CPU has).
Isa active_isa();

// n: elements, a multiple of the type's block size. src: n / block_size consecutive blocks.
using DequantRowFn = void (*)(const void* src, float* dst, int64_t n);
using DotRowFn = float (*)(const void* src, const float* x, int64_t n);
using DotF32Fn = float (*)(const float* a, const float* b, int64_t n);

struct RowKernels {
    DequantRowFn dequant_row = nullptr;
    DotRowFn dot_row = nullptr;
};

// Kernels of `type` for `isa`. Every table is complete: no SIMD table borrows a scalar entry (every
// supported type has avx2 and avx512 kernels, tested), because a borrowed scalar dot_row would not
// be bit-identical to the SIMD dot_f32 that prefill uses, breaking the invariant above.
// Throws UnsupportedError naming the type when sharpi has no kernel for it.
const RowKernels& row_kernels(GgmlType type, Isa isa);
inline const RowKernels& row_kernels(GgmlType type) {
    return row_kernels(type, active_isa());
}

DotF32Fn dot_f32_kernel(Isa isa);
inline float dot_f32(const float* a, const float* b, int64_t n) {
    return dot_f32_kernel(active_isa())(a, b, n);
}

// Prefill helper: y[t * ldy + r] = dot_f32(w + r * ldw, x + t * ldx, n) for r < n_rows and
// t < n_tokens, each result bit-identical to that ISA's dot_f32, computed in register tiles of
// several rows x several tokens that share their loads (dot_f32 alone needs two loads per FMA).
using DotF32TileFn = void (*)(const float* w, int64_t ldw, int64_t n_rows, const float* x, int64_t ldx,
                              int64_t n_tokens, int64_t n, float* y, int64_t ldy);
DotF32TileFn dot_f32_tile_kernel(Isa isa);

}  // namespace sharpi::cpu
