// One thread per element: block i / B, element i % B of it (bm_dequant).
#include "ops/common.cuh"
#include "ops/dequantize.cuh"

namespace sharpi::cuda {
namespace {

template <typename Block>
__global__ void dequantize_kernel(const Block* __restrict__ src, float* __restrict__ dst, int64_t n) {
    constexpr int kBlock = BmBlockSize<Block>::value;
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = bm_dequant(src + i / kBlock, static_cast<int>(i % kBlock));
}

}  // namespace

void launch_dequantize(GgmlType type, const void* src, float* dst, int64_t n, cudaStream_t stream) {
    if (n <= 0) return;
    dispatch_type(type, "dequantize", [&](auto tag) {
        using Block = BlockOf<decltype(tag)>;
        dequantize_kernel<Block><<<div_up(n, 256), 256, 0, stream>>>(static_cast<const Block*>(src), dst, n);
    });
    SHARPI_CUDA_CHECK_LAUNCH("dequantize");
}

}  // namespace sharpi::cuda
