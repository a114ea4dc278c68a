// Run-time selection of the fast-mode kernels (qdot.h). The ISA is the caller's (matmul passes the
// process's active_isa(), tests name one); on Isa::avx512 the VNNI file serves when CPUID reports
// VNNI, else the AVX2 file: both give the same bits (qdot.h), so the choice never shows in results.
#include "cpu/quant/qdot.h"

#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "cpu/quant/qdot_impl.h"
#include "quant/blocks.h"
#include "sharpi/errors.h"

namespace sharpi::cpu {

const char* act_format_name(ActFormat format) {
    switch (format) {
        case ActFormat::f32:
            return "f32";
        case ActFormat::q8_0:
            return "q8_0";
        case ActFormat::q8_1:
            return "q8_1";
        case ActFormat::q8_K:
            return "q8_K";
    }
    return "unknown";
}

ActFormat act_format(GgmlType weight) {
    switch (weight) {
        case GgmlType::Q4_0:
        case GgmlType::Q5_0:
        case GgmlType::Q8_0:
        case GgmlType::MXFP4:
        case GgmlType::IQ4_NL:
            return ActFormat::q8_0;
        case GgmlType::Q4_1:
        case GgmlType::Q5_1:
            return ActFormat::q8_1;
        case GgmlType::Q2_K:
        case GgmlType::Q3_K:
        case GgmlType::Q4_K:
        case GgmlType::Q5_K:
        case GgmlType::Q6_K:
        case GgmlType::IQ4_XS:
        case GgmlType::IQ3_S:
        case GgmlType::IQ3_XXS:
        case GgmlType::IQ2_S:
        case GgmlType::IQ2_XS:
        case GgmlType::IQ2_XXS:
        case GgmlType::IQ1_S:
        case GgmlType::IQ1_M:
            return ActFormat::q8_K;
        default:
            return ActFormat::f32;
    }
}

int64_t act_block_size(ActFormat format) {
    switch (format) {
        case ActFormat::q8_0:
        case ActFormat::q8_1:
            return QK8_0;
        case ActFormat::q8_K:
            return QK_K;
        case ActFormat::f32:
            break;
    }
    return 1;
}

size_t act_row_bytes(ActFormat format, int64_t n) {
    const size_t blocks = static_cast<size_t>(n / act_block_size(format));
    switch (format) {
        case ActFormat::q8_0:
            return blocks * sizeof(block_q8_0);
        case ActFormat::q8_1:
            return blocks * sizeof(block_q8_1);
        case ActFormat::q8_K:
            return blocks * sizeof(block_q8_K);
        case ActFormat::f32:
            break;
    }
    return static_cast<size_t>(n) * sizeof(float);
}

namespace {

bool cpu_has_avx512vnni() {
#if defined(__x86_64__) || defined(__i386__)
    static const bool has = [] {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512vnni") != 0;
    }();
    return has;
#else
    return false;
#endif
}

const detail::QuantIsaKernels& quant_isa_kernels(Isa isa) {
    if (static_cast<int>(isa) > static_cast<int>(detect_isa())) {
        throw InvalidArgument(std::string("[quant] ISA ") + isa_name(isa) +
                              " requested, but this CPU runs at most " + isa_name(detect_isa()));
    }
    switch (isa) {
        case Isa::avx512:
            return cpu_has_avx512vnni() ? detail::avx512vnni_quant_kernels() : detail::avx2_quant_kernels();
        case Isa::avx2:
            return detail::avx2_quant_kernels();
        case Isa::scalar:
            break;
    }
    return detail::scalar_quant_kernels();
}

}  // namespace

const QuantDotKernels* quant_dot_kernels(GgmlType weight, Isa isa) {
    const uint32_t id = static_cast<uint32_t>(weight);
    if (id >= static_cast<uint32_t>(detail::kTypeTableSize)) return nullptr;
    const QuantDotKernels& k = quant_isa_kernels(isa).by_type[id];
    return k.vec_dot != nullptr ? &k : nullptr;
}

bool amx_available() {
#if defined(__x86_64__) && defined(__linux__)
    static const bool ok = [] {
        const char* env = std::getenv("SHARPI_AMX");
        if (env != nullptr && std::strcmp(env, "0") == 0) return false;
        if (!cpu_has_avx512vnni()) return false;
        unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
        if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
        if ((edx & (1u << 24)) == 0 || (edx & (1u << 25)) == 0) return false;  // AMX-TILE, AMX-INT8
        if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0 || (ecx & (1u << 27)) == 0) return false;  // OSXSAVE
        uint32_t xcr0_lo = 0, xcr0_hi = 0;
        __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
        if ((xcr0_lo & (3u << 17)) != (3u << 17)) return false;  // XTILECFG, XTILEDATA enabled by the OS
        // Linux hands the tile data state to a process only on request (ARCH_REQ_XCOMP_PERM,
        // XFEATURE_XTILEDATA); every thread of the process may then use it.
        constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
        return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
    }();
    return ok;
#else
    return false;
#endif
}

const AmxKernels* amx_kernels(GgmlType weight, Isa isa) {
    if (isa != Isa::avx512 || !amx_available()) return nullptr;
    return detail::amx_kernels_for(weight);
}

QuantizeActFn quantize_act_kernel(ActFormat format, Isa isa) {
    if (format == ActFormat::f32) throw InvalidArgument("[quant] f32 activations are not quantized");
    return quant_isa_kernels(isa).quantize[static_cast<int>(format)];
}

}  // namespace sharpi::cpu
