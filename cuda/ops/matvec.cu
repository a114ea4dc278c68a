// One warp per (weight row, token); four warps per thread block; the warp's dot is warp_row_dot
// (row_dot.cuh). Rows of a thread block share the token, so x stays in L1/L2.
#include "ops/common.cuh"
#include "ops/matmul_q8.cuh"
#include "ops/matvec.cuh"
#include "ops/row_dot.cuh"

namespace sharpi::cuda {
namespace {

constexpr int kRowsPerBlock = 4;

// y[token * n_rows + row] = W[row] . x[token] (x: f32 rows, or q8 activation rows when kInt8).
template <typename Block, bool kInt8>
__global__ void matvec_kernel(const Block* __restrict__ w, int64_t n_rows, int64_t n_cols,
                              const void* __restrict__ x, size_t x_row_bytes, float* __restrict__ y) {
    constexpr int kBlock = BmBlockSize<Block>::value;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
    const int64_t token = blockIdx.y;
    if (row >= n_rows) return;
    const void* xt = static_cast<const unsigned char*>(x) + token * x_row_bytes;
    const float sum = warp_row_dot<Block, kInt8>(w + row * (n_cols / kBlock), xt, n_cols);
    if (threadIdx.x % kWarp == 0) y[token * n_rows + row] = sum;
}

template <typename Block>
__global__ void quantize_act_kernel(const float* __restrict__ x, int64_t n_cols, int64_t n_tokens,
                                    typename BmActBlock<Block>::type* __restrict__ xq) {
    constexpr int kBlock = BmBlockSize<Block>::value;
    const int64_t blocks_per_row = n_cols / kBlock;
    const int64_t ib = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (ib >= blocks_per_row * n_tokens) return;
    // Rows are whole blocks, so block ib of the flattened [n_tokens, n_cols] is elements ib * kBlock...
    bm_quantize(x + ib * kBlock, xq + ib);
}

}  // namespace

void launch_matvec_f32(GgmlType type, const void* w, int64_t n_rows, int64_t n_cols, const float* x,
                       int64_t n_tokens, float* y, cudaStream_t stream) {
    if (n_rows <= 0 || n_tokens <= 0) return;
    dispatch_type(type, "matvec", [&](auto tag) {
        using Block = BlockOf<decltype(tag)>;
        const dim3 grid(div_up(n_rows, kRowsPerBlock), static_cast<unsigned int>(n_tokens));
        matvec_kernel<Block, false><<<grid, kRowsPerBlock * kWarp, 0, stream>>>(
            static_cast<const Block*>(w), n_rows, n_cols, x, static_cast<size_t>(n_cols) * sizeof(float), y);
    });
    SHARPI_CUDA_CHECK_LAUNCH("matvec f32");
}

size_t q8_act_row_bytes(GgmlType type, int64_t n_cols) {
    size_t bytes = 0;
    bm_dispatch(type, [&](auto tag) {
        using Block = BlockOf<decltype(tag)>;
        if constexpr (bm_has_int8<Block>()) {
            bytes = static_cast<size_t>(n_cols / BmBlockSize<Block>::value) *
                    sizeof(typename BmActBlock<Block>::type);
        }
    });
    return bytes;
}

void launch_quantize_act(GgmlType type, const float* x, int64_t n_cols, int64_t n_tokens, void* xq,
                         cudaStream_t stream) {
    if (n_tokens <= 0) return;
    dispatch_type(type, "quantize activations", [&](auto tag) {
        using Block = BlockOf<decltype(tag)>;
        if constexpr (bm_has_int8<Block>()) {
            using Act = typename BmActBlock<Block>::type;
            const int64_t n_blocks = n_cols / BmBlockSize<Block>::value * n_tokens;
            quantize_act_kernel<Block>
                <<<div_up(n_blocks, 128), 128, 0, stream>>>(x, n_cols, n_tokens, static_cast<Act*>(xq));
        } else {
            throw UnsupportedError(std::string("[cuda] quantize activations: type ") +
                                   ggml_type_traits(type).name + " has no int8 path");
        }
    });
    SHARPI_CUDA_CHECK_LAUNCH("quantize activations");
}

void launch_matvec_q8(GgmlType type, const void* w, int64_t n_rows, int64_t n_cols, const void* xq,
                      int64_t n_tokens, float* y, cudaStream_t stream) {
    if (n_rows <= 0 || n_tokens <= 0) return;
    dispatch_type(type, "matvec int8", [&](auto tag) {
        using Block = BlockOf<decltype(tag)>;
        if constexpr (bm_has_int8<Block>()) {
            const dim3 grid(div_up(n_rows, kRowsPerBlock), static_cast<unsigned int>(n_tokens));
            matvec_kernel<Block, true><<<grid, kRowsPerBlock * kWarp, 0, stream>>>(
                static_cast<const Block*>(w), n_rows, n_cols, xq, q8_act_row_bytes(type, n_cols), y);
        } else {
            throw UnsupportedError(std::string("[cuda] matvec int8: type ") + ggml_type_traits(type).name +
                                   " has no int8 path");
        }
    });
    SHARPI_CUDA_CHECK_LAUNCH("matvec int8");
}

void launch_linear(GgmlType type, const void* w, int64_t n_rows, int64_t n_cols, const float* x,
                   int64_t n_tokens, bool int8, void* xq, float* y, cudaStream_t stream) {
    if (int8 && q8_act_row_bytes(type, n_cols) > 0) {
        launch_quantize_act(type, x, n_cols, n_tokens, xq, stream);
        if (n_tokens == 1) {
            launch_matvec_q8(type, w, n_rows, n_cols, xq, 1, y, stream);
        } else {
            launch_matmul_q8(type, w, n_rows, n_cols, xq, n_tokens, y, stream);
        }
    } else {
        launch_matvec_f32(type, w, n_rows, n_cols, x, n_tokens, y, stream);
    }
}

}  // namespace sharpi::cuda
