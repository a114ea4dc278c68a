// Private to cpu/quant: the per-ISA tables of the fast-mode kernels (qdot.h) that qdot.cpp
// chooses from. The ODR rule of kernels_impl.h applies: the SIMD files keep everything static or
// in an anonymous namespace.
#pragma once

#include "cpu/quant/kernels_impl.h"
#include "cpu/quant/qdot.h"

namespace sharpi::cpu::detail {

struct QuantIsaKernels {
    QuantDotKernels by_type[kTypeTableSize];
    QuantizeActFn quantize[4];  // by ActFormat; [f32] stays null
};

const QuantIsaKernels& scalar_quant_kernels();
const QuantIsaKernels& avx2_quant_kernels();         // call only when detect_isa() >= Isa::avx2
const QuantIsaKernels& avx512vnni_quant_kernels();   // call only when the CPU has AVX-512 VNNI
const AmxKernels* amx_kernels_for(GgmlType weight);  // call only when amx_available()

}  // namespace sharpi::cpu::detail

// The table of a SIMD file, written once (a macro for the reason given in kernels_impl.h). The
// file defines in its anonymous namespace: the quantizers quantize_q8_0 / quantize_q8_1 /
// quantize_q8_K, the decoders KQ2_K .. KQ6_K, KIQ4_XS, KIQ3_XXS, KIQ2_XXS and KIq<Block, unpack>
// (the other 256-element IQ types)
// and B32Q4_0 .. B32Q8_0, B32IQ4_NL, and the row functions
// k_vec_dot<D> / k_vec_dot_tile<D> and b32_vec_dot<D> / b32_vec_dot_tile<D>.
#define SHARPI_QDOT_TABLE(table_name)                                                                \
    template <typename D>                                                                            \
    constexpr QuantDotKernels k_entry() {                                                            \
        return QuantDotKernels{&k_vec_dot<D>, &k_vec_dot_tile<D>};                                   \
    }                                                                                                \
    template <typename D>                                                                            \
    constexpr QuantDotKernels b32_entry() {                                                          \
        return QuantDotKernels{&b32_vec_dot<D>, &b32_vec_dot_tile<D>};                               \
    }                                                                                                \
    constexpr QuantIsaKernels make_##table_name() {                                                  \
        QuantIsaKernels t{};                                                                         \
        t.by_type[static_cast<int>(GgmlType::Q4_0)] = b32_entry<B32Q4_0>();                          \
        t.by_type[static_cast<int>(GgmlType::Q4_1)] = b32_entry<B32Q4_1>();                          \
        t.by_type[static_cast<int>(GgmlType::Q5_0)] = b32_entry<B32Q5_0>();                          \
        t.by_type[static_cast<int>(GgmlType::Q5_1)] = b32_entry<B32Q5_1>();                          \
        t.by_type[static_cast<int>(GgmlType::Q8_0)] = b32_entry<B32Q8_0>();                          \
        t.by_type[static_cast<int>(GgmlType::Q2_K)] = k_entry<KQ2_K>();                              \
        t.by_type[static_cast<int>(GgmlType::Q3_K)] = k_entry<KQ3_K>();                              \
        t.by_type[static_cast<int>(GgmlType::Q4_K)] = k_entry<KQ4_K>();                              \
        t.by_type[static_cast<int>(GgmlType::Q5_K)] = k_entry<KQ5_K>();                              \
        t.by_type[static_cast<int>(GgmlType::Q6_K)] = k_entry<KQ6_K>();                              \
        t.by_type[static_cast<int>(GgmlType::MXFP4)] = b32_entry<B32MX4>();                          \
        t.by_type[static_cast<int>(GgmlType::IQ4_NL)] = b32_entry<B32IQ4_NL>();                      \
        t.by_type[static_cast<int>(GgmlType::IQ4_XS)] = k_entry<KIQ4_XS>();                          \
        t.by_type[static_cast<int>(GgmlType::IQ3_S)] = k_entry<KIq<block_iq3_s, unpack_iq3_s>>();    \
        t.by_type[static_cast<int>(GgmlType::IQ3_XXS)] = k_entry<KIQ3_XXS>();                        \
        t.by_type[static_cast<int>(GgmlType::IQ2_S)] = k_entry<KIq<block_iq2_s, unpack_iq2_s>>();    \
        t.by_type[static_cast<int>(GgmlType::IQ2_XS)] = k_entry<KIq<block_iq2_xs, unpack_iq2_xs>>(); \
        t.by_type[static_cast<int>(GgmlType::IQ2_XXS)] = k_entry<KIQ2_XXS>();                        \
        t.by_type[static_cast<int>(GgmlType::IQ1_S)] = k_entry<KIq<block_iq1_s, unpack_iq1_s>>();    \
        t.by_type[static_cast<int>(GgmlType::IQ1_M)] = k_entry<KIq<block_iq1_m, unpack_iq1_m>>();    \
        t.quantize[static_cast<int>(ActFormat::q8_0)] = &quantize_q8_0;                              \
        t.quantize[static_cast<int>(ActFormat::q8_1)] = &quantize_q8_1;                              \
        t.quantize[static_cast<int>(ActFormat::q8_K)] = &quantize_q8_K;                              \
        return t;                                                                                    \
    }                                                                                                \
    constexpr QuantIsaKernels table_name = make_##table_name();
