// Private to cpu/quant: the per-ISA kernel tables that dispatch.cpp chooses from, and the scale
// unpacking that every ISA shares.
//
// ODR hazard, and the rule that avoids it: kernels_avx2.cpp and kernels_avx512.cpp are compiled
// with ISA flags. An inline function with external linkage (a header `inline`, a template, most of
// the STL) used there may be emitted out of line with AVX-512 instructions, and the linker may then
// pick that copy for a caller on a CPU without AVX-512. So everything in this header is `static`
// (one private copy per file) or plain data, and the SIMD files use only intrinsics, their own
// static functions and libc.
//
// Rounding: the dequantized values must equal the gguf package's numpy results bit for bit. Every
// formula is a product of an f16 scale (11-bit significand) and small integers (scale <= 8 bits,
// quant <= 6 bits), optionally plus or minus another such product. Those products are exact in
// f32 except Q6_K's (d * sc) * (q - 32), which is a lone multiply; so the only rounding is the
// final add or subtract, and evaluating a*b+c as one FMA (as GCC's default -ffp-contract=fast may
// do) gives the same value as multiply-then-add. Any new formula must keep that property (the
// tests compare with numpy bitwise and would catch it).
#pragma once

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "cpu/quant/kernels.h"
#include "quant/blocks.h"

namespace sharpi::cpu::detail {

// Tables are indexed by the GGML type id; ids at or above this have no kernel.
constexpr int kTypeTableSize = 40;

// One ISA's kernels. Every type sharpi supports has both entries in every table (tested): a SIMD
// table may not borrow scalar entries, because the bitwise invariant of kernels.h ties dot_row to
// the same ISA's dot_f32.
struct IsaKernels {
    RowKernels by_type[kTypeTableSize];
    DotF32Fn dot_f32;
    DotF32TileFn dot_f32_tile;
};

const IsaKernels& scalar_kernels();
const IsaKernels& avx2_kernels();    // call only when detect_isa() >= Isa::avx2
const IsaKernels& avx512_kernels();  // call only when detect_isa() == Isa::avx512

// Q4_K / Q5_K: 8 sub-blocks of 32, each with a 6-bit scale and a 6-bit min packed in 12 bytes:
//   j < 4:  sc = s[j] & 63,                           m = s[j + 4] & 63
//   j >= 4: sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4, m = (s[j + 4] >> 4) | (s[j] >> 6) << 4
// Computed four bytes at a time on 32-bit little-endian words (each byte lane is independent
// because every shift is followed by a mask that drops the bits that crossed from the
// neighbouring byte). Returns the words {sc[0..3], sc[4..7], m[0..3], m[4..7]}.
struct Q4KScaleWords {
    uint32_t sc_lo, sc_hi, m_lo, m_hi;
};
static inline Q4KScaleWords unpack_q4_K_scale_min(const uint8_t* s) {
    uint32_t w0, w1, w2;  // bytes 0-3, 4-7, 8-11
    memcpy(&w0, s, 4);
    memcpy(&w1, s + 4, 4);
    memcpy(&w2, s + 8, 4);
    Q4KScaleWords out;
    out.sc_lo = w0 & 0x3F3F3F3Fu;
    out.m_lo = w1 & 0x3F3F3F3Fu;
    out.sc_hi = (w2 & 0x0F0F0F0Fu) | (((w0 >> 6) & 0x03030303u) << 4);
    out.m_hi = ((w2 >> 4) & 0x0F0F0F0Fu) | (((w1 >> 6) & 0x03030303u) << 4);
    return out;
}

// Q3_K: 16 6-bit scales in 12 bytes, stored biased by 32. Scale i has its low 4 bits in byte i
// (i < 8, low nibble) or byte i - 8 (i >= 8, high nibble), and its high 2 bits in byte 8 + i % 4
// at bit 2 * (i / 4). Computed four scales at a time on 32-bit little-endian words as in
// unpack_q4_K_scale_min; returns the biased bytes {scale[0..3], [4..7], [8..11], [12..15]}.
static inline void unpack_q3_K_scales(const uint8_t* s, uint32_t out[4]) {
    uint32_t w0, w1, w2;  // bytes 0-3, 4-7, 8-11
    memcpy(&w0, s, 4);
    memcpy(&w1, s + 4, 4);
    memcpy(&w2, s + 8, 4);
    out[0] = (w0 & 0x0F0F0F0Fu) | ((w2 & 0x03030303u) << 4);
    out[1] = (w1 & 0x0F0F0F0Fu) | (((w2 >> 2) & 0x03030303u) << 4);
    out[2] = ((w0 >> 4) & 0x0F0F0F0Fu) | (((w2 >> 4) & 0x03030303u) << 4);
    out[3] = ((w1 >> 4) & 0x0F0F0F0Fu) | (((w2 >> 6) & 0x03030303u) << 4);
}

// MXFP4 (blocks.h): the doubled e2m1 values, and the halved E8M0 scale 2^(e - 128) built from its
// bits as ggml's GGML_E8M0_TO_FP32_HALF (e < 2 is an f32 subnormal). scale * value is exact in f32
// (a power of two times an integer <= 12, never below the subnormal step), so every ISA and numpy
// agree bit for bit. The SIMD decoders are DecodeMX4 (row kernels) and B32MX4 (fast mode).
alignas(16) static const int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static inline float mxfp4_scale(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// Decode reads each weight byte once, and a dot_row spends enough instructions per byte that the
// hardware prefetcher alone leaves the core waiting on DRAM. The SIMD dot_rows therefore prefetch
// the cache lines kPrefetchDistance bytes past the bytes they are about to decode; past the end
// of a row that is the next row of the matrix, and a prefetch never faults. Measured on one core
// of the dev machine (64 MiB matrix): Q4_K 4.6 -> 9.3 GB/s of weights, Q8_0 7.7 -> 14.3, Q4_0
// 4.3 -> 8.5; 2-6 KiB all did about equally well, 512 B clearly worse.
constexpr size_t kPrefetchDistance = 3072;

static inline void prefetch_ahead(const void* p, size_t bytes) {
    const char* ahead = static_cast<const char*>(p) + kPrefetchDistance;
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(ahead + off, 0, 3);
}

// Per-block scales are computed once as a vector and stored to a small stack array; the SIMD
// decoders then broadcast one entry per sub-block. Left alone, the compiler keeps the vector in a
// register and broadcasts with shuffles (vpermd; vpermilps + vperm2f128 on AVX2), port-5 uops that
// compete with the decoding itself (16-28 extra per Q4_K block). This empty asm tells the
// compiler the array may have changed in memory, so each broadcast becomes a broadcast load,
// which needs only a load port. Measured: Q4_K AVX-512 8.4 -> 9.9 GB/s on one core, in cache.
static inline void keep_in_memory(float (&values)[16]) {
    asm volatile("" : "+m"(values));
}

}  // namespace sharpi::cpu::detail

// The kernel table of a SIMD file (kernels_avx2.cpp, kernels_avx512.cpp), written once. Each SIMD
// file defines, in its anonymous namespace, the same names: the row loops dequant_plain<Load> /
// dot_plain<Load> and dequant_row_blocks<Decode> / dot_row_blocks<Decode>, the loaders LoadF32,
// LoadF16, LoadBF16 and the block decoders DecodeQ4_0 .. DecodeQ6_K, DecodeIQ4_NL, DecodeIQ4_XS and
// DecodeIqGrid<Block, unpack> (iq_unpack.h). A macro rather than a template
// in this header because of the ODR rule above: it expands to file-local code in each SIMD file.
#define SHARPI_SIMD_KERNEL_TABLE(table_name, dot_f32_fn, dot_f32_tile_fn)            \
    template <typename D>                                                            \
    constexpr RowKernels block_entry() {                                             \
        return RowKernels{&dequant_row_blocks<D>, &dot_row_blocks<D>};               \
    }                                                                                \
    template <typename Load>                                                         \
    constexpr RowKernels plain_entry() {                                             \
        return RowKernels{&dequant_plain<Load>, &dot_plain<Load>};                   \
    }                                                                                \
    constexpr IsaKernels make_##table_name() {                                       \
        IsaKernels t{};                                                              \
        t.by_type[static_cast<int>(GgmlType::F32)] = plain_entry<LoadF32>();         \
        t.by_type[static_cast<int>(GgmlType::F16)] = plain_entry<LoadF16>();         \
        t.by_type[static_cast<int>(GgmlType::BF16)] = plain_entry<LoadBF16>();       \
        t.by_type[static_cast<int>(GgmlType::Q4_0)] = block_entry<DecodeQ4_0>();     \
        t.by_type[static_cast<int>(GgmlType::Q4_1)] = block_entry<DecodeQ4_1>();     \
        t.by_type[static_cast<int>(GgmlType::Q5_0)] = block_entry<DecodeQ5_0>();     \
        t.by_type[static_cast<int>(GgmlType::Q5_1)] = block_entry<DecodeQ5_1>();     \
        t.by_type[static_cast<int>(GgmlType::Q8_0)] = block_entry<DecodeQ8_0>();     \
        t.by_type[static_cast<int>(GgmlType::Q2_K)] = block_entry<DecodeQ2_K>();     \
        t.by_type[static_cast<int>(GgmlType::Q3_K)] = block_entry<DecodeQ3_K>();     \
        t.by_type[static_cast<int>(GgmlType::Q4_K)] = block_entry<DecodeQ4_K>();     \
        t.by_type[static_cast<int>(GgmlType::Q5_K)] = block_entry<DecodeQ5_K>();     \
        t.by_type[static_cast<int>(GgmlType::Q6_K)] = block_entry<DecodeQ6_K>();     \
        t.by_type[static_cast<int>(GgmlType::MXFP4)] = block_entry<DecodeMX4>();     \
        t.by_type[static_cast<int>(GgmlType::IQ4_NL)] = block_entry<DecodeIQ4_NL>(); \
        t.by_type[static_cast<int>(GgmlType::IQ4_XS)] = block_entry<DecodeIQ4_XS>(); \
        t.by_type[static_cast<int>(GgmlType::IQ3_S)] =                               \
            block_entry<DecodeIqGrid<block_iq3_s, unpack_iq3_s>>();                  \
        t.by_type[static_cast<int>(GgmlType::IQ3_XXS)] =                             \
            block_entry<DecodeIqGrid<block_iq3_xxs, unpack_iq3_xxs>>();              \
        t.by_type[static_cast<int>(GgmlType::IQ2_S)] =                               \
            block_entry<DecodeIqGrid<block_iq2_s, unpack_iq2_s>>();                  \
        t.by_type[static_cast<int>(GgmlType::IQ2_XS)] =                              \
            block_entry<DecodeIqGrid<block_iq2_xs, unpack_iq2_xs>>();                \
        t.by_type[static_cast<int>(GgmlType::IQ2_XXS)] =                             \
            block_entry<DecodeIqGrid<block_iq2_xxs, unpack_iq2_xxs>>();              \
        t.by_type[static_cast<int>(GgmlType::IQ1_S)] =                               \
            block_entry<DecodeIqGrid<block_iq1_s, unpack_iq1_s>>();                  \
        t.by_type[static_cast<int>(GgmlType::IQ1_M)] =                               \
            block_entry<DecodeIqGrid<block_iq1_m, unpack_iq1_m>>();                  \
        t.dot_f32 = &dot_f32_fn;                                                     \
        t.dot_f32_tile = &dot_f32_tile_fn;                                           \
        return t;                                                                    \
    }                                                                                \
    constexpr IsaKernels table_name = make_##table_name();
