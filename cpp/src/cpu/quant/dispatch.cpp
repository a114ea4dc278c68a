// Run-time kernel selection: CPUID decides what the CPU can run; SHARPI_ISA may only lower it.
//
// The active ISA is decided once per process (the first call that succeeds) and never changes
// afterwards: prefill and decode must use kernels of the same ISA, or the bitwise invariant in
// kernels.h would not tie their logits together. The SIMD tables are touched only after CPUID
// said the CPU runs them.
#include <stdlib.h>
#include <string.h>

#include <string>

#include "cpu/quant/kernels.h"
#include "cpu/quant/kernels_impl.h"
#include "sharpi/errors.h"

namespace sharpi::cpu {

const char* isa_name(Isa isa) {
    switch (isa) {
        case Isa::scalar:
            return "scalar";
        case Isa::avx2:
            return "avx2";
        case Isa::avx512:
            return "avx512";
    }
    return "unknown";
}

bool parse_isa_name(const char* name, Isa* isa) {
    for (Isa candidate : {Isa::scalar, Isa::avx2, Isa::avx512}) {
        if (strcmp(name, isa_name(candidate)) == 0) {
            *isa = candidate;
            return true;
        }
    }
    return false;
}

Isa detect_isa() {
#if defined(__x86_64__) || defined(__i386__)
    // __builtin_cpu_supports also checks that the OS saves the wider registers (XCR0).
    static const Isa detected = [] {
        __builtin_cpu_init();
        const bool avx2 =
            __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
        const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
        return avx512 ? Isa::avx512 : (avx2 ? Isa::avx2 : Isa::scalar);
    }();
    return detected;
#else
    return Isa::scalar;
#endif
}

Isa active_isa() {
    // Throws (and is retried on the next call) while SHARPI_ISA holds a bad value.
    static const Isa active = [] {
        const Isa best = detect_isa();
        const char* env = getenv("SHARPI_ISA");
        if (env == nullptr || env[0] == '\0') return best;
        Isa requested;
        if (!parse_isa_name(env, &requested)) {
            throw InvalidArgument(std::string("[quant] SHARPI_ISA=") + env +
                                  ": expected scalar, avx2 or avx512");
        }
        return static_cast<int>(requested) < static_cast<int>(best) ? requested : best;
    }();
    return active;
}

namespace {

const detail::IsaKernels& isa_kernels(Isa isa) {
    if (static_cast<int>(isa) > static_cast<int>(detect_isa())) {
        throw InvalidArgument(std::string("[quant] ISA ") + isa_name(isa) +
                              " requested, but this CPU runs at most " + isa_name(detect_isa()));
    }
    switch (isa) {
        case Isa::avx512:
            return detail::avx512_kernels();
        case Isa::avx2:
            return detail::avx2_kernels();
        case Isa::scalar:
            break;
    }
    return detail::scalar_kernels();
}

}  // namespace

const RowKernels& row_kernels(GgmlType type, Isa isa) {
    const detail::IsaKernels& table = isa_kernels(isa);
    const uint32_t id = static_cast<uint32_t>(type);
    if (id < static_cast<uint32_t>(detail::kTypeTableSize)) {
        const RowKernels& k = table.by_type[id];
        if (k.dequant_row != nullptr && k.dot_row != nullptr) return k;
    }
    const GgmlTypeTraits& traits = ggml_type_traits(type);
    std::string name = traits.name;
    if (traits.block_size == 0) name += " (id " + std::to_string(id) + ")";
    throw UnsupportedError("[quant] no CPU kernel for type " + name);
}

DotF32Fn dot_f32_kernel(Isa isa) {
    return isa_kernels(isa).dot_f32;
}

DotF32TileFn dot_f32_tile_kernel(Isa isa) {
    return isa_kernels(isa).dot_f32_tile;
}

}  // namespace sharpi::cpu
