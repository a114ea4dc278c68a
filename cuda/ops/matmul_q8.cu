// Tile: kTileRows rows (one warp each) x kTileTokens tokens. The activation blocks of the tile's
// tokens for blocks [c0, c0 + kChunk) are copied to shared memory by the whole thread block; lane
// l of a warp then owns weight block c0 + l (kChunk == 32 lanes), loads it once and dots it with
// every token's staged block. Lane l therefore accumulates blocks l, l + 32, ... in increasing
// order, exactly the per-lane order of matvec_q8_kernel, and the final warp_sum is the same tree:
// the results equal the matvec's bit for bit.
#include "ops/common.cuh"
#include "ops/matmul_q8.cuh"

namespace sharpi::cuda {
namespace {

constexpr int kTileRows = 4;
constexpr int kTileTokens = 8;
constexpr int kChunk = kWarp;

template <typename Block>
__global__ void matmul_q8_kernel(const Block* __restrict__ w, int64_t n_rows, int64_t n_cols,
                                 const typename BmActBlock<Block>::type* __restrict__ xq, int64_t n_tokens,
                                 float* __restrict__ y) {
    using Act = typename BmActBlock<Block>::type;
    extern __shared__ unsigned char smem_raw[];
    Act* staged = reinterpret_cast<Act*>(smem_raw);  // [kTileTokens][kChunk]
    constexpr int kBlock = BmBlockSize<Block>::value;
    const int64_t nb = n_cols / kBlock;
    const int lane = threadIdx.x % kWarp;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kTileRows + threadIdx.x / kWarp;
    const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kTileTokens;
    const int n_tok = static_cast<int>(n_tokens - t0 < kTileTokens ? n_tokens - t0 : kTileTokens);
    float acc[kTileTokens];
    for (int t = 0; t < kTileTokens; ++t) acc[t] = 0.0f;
    for (int64_t c0 = 0; c0 < nb; c0 += kChunk) {
        const int n_chunk = static_cast<int>(nb - c0 < kChunk ? nb - c0 : kChunk);
        __syncthreads();  // the previous chunk's reads are done
        // Stage as 2-byte words (q8_0 blocks are 34 bytes: 2-aligned, not 4).
        constexpr int kWords = static_cast<int>(sizeof(Act) / 2);
        static_assert(sizeof(Act) % 2 == 0, "activation blocks are whole 16-bit words");
        for (int idx = threadIdx.x; idx < n_tok * n_chunk * kWords; idx += blockDim.x) {
            const int word = idx % kWords, c = (idx / kWords) % n_chunk, t = idx / (kWords * n_chunk);
            const uint16_t* src = reinterpret_cast<const uint16_t*>(xq + (t0 + t) * nb + c0 + c);
            reinterpret_cast<uint16_t*>(staged + t * kChunk + c)[word] = src[word];
        }
        __syncthreads();
        if (row < n_rows && lane < n_chunk) {
            const Block* wb = w + row * nb + c0 + lane;
            for (int t = 0; t < n_tok; ++t) acc[t] += bm_dot_q8(wb, staged + t * kChunk + lane);
        }
    }
    if (row >= n_rows) return;
    for (int t = 0; t < n_tok; ++t) {
        const float sum = warp_sum(acc[t]);
        if (lane == 0) y[(t0 + t) * n_rows + row] = sum;
    }
}

}  // namespace

void launch_matmul_q8(GgmlType type, const void* w, int64_t n_rows, int64_t n_cols, const void* xq,
                      int64_t n_tokens, float* y, cudaStream_t stream) {
    if (n_rows <= 0 || n_tokens <= 0) return;
    dispatch_type(type, "matmul int8", [&](auto tag) {
        using Block = BlockOf<decltype(tag)>;
        if constexpr (bm_has_int8<Block>()) {
            using Act = typename BmActBlock<Block>::type;
            const size_t smem =
                sizeof(Act) * kChunk * kTileTokens;  // q8_K: 74752 B, above the 48 KiB default
            auto kernel = matmul_q8_kernel<Block>;
            cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)),
                       "matmul int8: shared memory");
            const dim3 grid(div_up(n_rows, kTileRows), div_up(n_tokens, kTileTokens));
            kernel<<<grid, kTileRows * kWarp, smem, stream>>>(static_cast<const Block*>(w), n_rows, n_cols,
                                                              static_cast<const Act*>(xq), n_tokens, y);
        } else {
            throw UnsupportedError(std::string("[cuda] matmul int8: type ") + ggml_type_traits(type).name +
                                   " has no int8 path");
        }
    });
    SHARPI_CUDA_CHECK_LAUNCH("matmul int8");
}

}  // namespace sharpi::cuda
