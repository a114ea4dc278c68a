// GGML tensor types as numbered in GGUF files, and the one traits table that maps a type to its
// block size and bytes per block. Types sharpi cannot compute have supported = false; loading a
// file that uses one for a tensor the model needs is an UnsupportedError naming the tensor.
#pragma once

#include <cstddef>
#include <cstdint>

namespace sharpi {

enum class GgmlType : uint32_t {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,
    IQ2_XXS = 16,
    IQ2_XS = 17,
    IQ3_XXS = 18,
    IQ1_S = 19,
    IQ4_NL = 20,
    IQ3_S = 21,
    IQ2_S = 22,
    IQ4_XS = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    IQ1_M = 29,
    BF16 = 30,
    TQ1_0 = 34,
    TQ2_0 = 35,
    MXFP4 = 39,
};

struct GgmlTypeTraits {
    const char* name;    // "q4_K": the spelling ggml and the gguf package use
    int64_t block_size;  // elements per block (1 for plain floats)
    size_t type_size;    // bytes per block
    bool supported;      // sharpi has dequantize and dot kernels for it
};

// Traits for any type id found in a file; unknown ids get {"unknown", 0, 0, false}.
const GgmlTypeTraits& ggml_type_traits(GgmlType type);
inline const GgmlTypeTraits& ggml_type_traits(uint32_t type) {
    return ggml_type_traits(static_cast<GgmlType>(type));
}

// Bytes of one row of n elements; n must be a multiple of the block size.
inline size_t ggml_row_size(GgmlType type, int64_t n) {
    const GgmlTypeTraits& t = ggml_type_traits(type);
    return t.block_size > 0 ? static_cast<size_t>(n / t.block_size) * t.type_size : 0;
}

}  // namespace sharpi
