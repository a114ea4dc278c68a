// Host side of block_math.cuh (see block_math_host.h). Plain C++: in a CUDA build CMake compiles
// this file with the host compiler beside the .cu files, in a CPU-only build beside the stub.
#include "block_math_host.h"

#include <cstring>
#include <string>
#include <type_traits>

#include "block_math.cuh"
#include "sharpi/errors.h"

namespace sharpi::cuda {
namespace {

std::string type_name(GgmlType type) {
    return ggml_type_traits(type).name;
}

[[noreturn]] void unsupported(GgmlType type, const char* what) {
    throw UnsupportedError(std::string("[cuda] block math: no ") + what + " for type " + type_name(type) +
                           " (id " + std::to_string(static_cast<uint32_t>(type)) + ")");
}

void check_whole_blocks(GgmlType type, size_t n_bytes, size_t block_bytes, const char* what) {
    if (n_bytes % block_bytes != 0) {
        throw InvalidArgument(std::string("[cuda] block math: ") + what + " has " + std::to_string(n_bytes) +
                              " bytes, not a whole number of " + type_name(type) + " blocks of " +
                              std::to_string(block_bytes) + " bytes");
    }
}

}  // namespace

bool host_has_block_math(GgmlType type) {
    return bm_dispatch(type, [](auto) {});
}

std::vector<float> host_dequantize(GgmlType type, const void* data, size_t n_bytes) {
    std::vector<float> out;
    const bool known = bm_dispatch(type, [&](auto tag) {
        using Block = std::remove_cv_t<std::remove_pointer_t<decltype(tag)>>;
        constexpr int kBlock = BmBlockSize<Block>::value;
        check_whole_blocks(type, n_bytes, sizeof(Block), "data");
        const size_t n_blocks = n_bytes / sizeof(Block);
        out.resize(n_blocks * kBlock);
        for (size_t ib = 0; ib < n_blocks; ++ib) {
            Block b;  // copied out: the bytes need not be aligned for the block's ggml_half fields
            std::memcpy(&b, static_cast<const uint8_t*>(data) + ib * sizeof(Block), sizeof(Block));
            for (int e = 0; e < kBlock; ++e) out[ib * kBlock + e] = bm_dequant(&b, e);
        }
    });
    if (!known) unsupported(type, "dequantize");
    return out;
}

std::vector<uint8_t> host_quantize_act(GgmlType weight, const float* x, int64_t n) {
    std::vector<uint8_t> out;
    bool has_int8 = false;
    const bool known = bm_dispatch(weight, [&](auto tag) {
        using Block = std::remove_cv_t<std::remove_pointer_t<decltype(tag)>>;
        if constexpr (bm_has_int8<Block>()) {
            using Act = typename BmActBlock<Block>::type;
            constexpr int kBlock = BmBlockSize<Block>::value;
            has_int8 = true;
            if (n < 0 || n % kBlock != 0) {
                throw InvalidArgument("[cuda] block math: n=" + std::to_string(n) +
                                      " is not a multiple of the activation block size " +
                                      std::to_string(kBlock));
            }
            out.resize(static_cast<size_t>(n / kBlock) * sizeof(Act));
            for (int64_t ib = 0; ib < n / kBlock; ++ib) {
                Act a;
                bm_quantize(x + ib * kBlock, &a);
                std::memcpy(out.data() + ib * sizeof(Act), &a, sizeof(Act));
            }
        }
    });
    if (!known || !has_int8) unsupported(weight, "int8 activation format");
    return out;
}

std::vector<float> host_dot_q8_blocks(GgmlType weight, const void* w, size_t w_bytes, const void* xq,
                                      size_t xq_bytes) {
    std::vector<float> out;
    bool has_int8 = false;
    const bool known = bm_dispatch(weight, [&](auto tag) {
        using Block = std::remove_cv_t<std::remove_pointer_t<decltype(tag)>>;
        if constexpr (bm_has_int8<Block>()) {
            using Act = typename BmActBlock<Block>::type;
            has_int8 = true;
            check_whole_blocks(weight, w_bytes, sizeof(Block), "weights");
            const size_t n_blocks = w_bytes / sizeof(Block);
            if (xq_bytes != n_blocks * sizeof(Act)) {
                throw InvalidArgument("[cuda] block math: " + std::to_string(n_blocks) + " " +
                                      type_name(weight) + " blocks need " +
                                      std::to_string(n_blocks * sizeof(Act)) +
                                      " bytes of activation blocks, got " + std::to_string(xq_bytes));
            }
            out.resize(n_blocks);
            for (size_t ib = 0; ib < n_blocks; ++ib) {
                Block b;
                Act a;
                std::memcpy(&b, static_cast<const uint8_t*>(w) + ib * sizeof(Block), sizeof(Block));
                std::memcpy(&a, static_cast<const uint8_t*>(xq) + ib * sizeof(Act), sizeof(Act));
                out[ib] = bm_dot_q8(&b, &a);
            }
        }
    });
    if (!known || !has_int8) unsupported(weight, "int8 dot");
    return out;
}

}  // namespace sharpi::cuda
