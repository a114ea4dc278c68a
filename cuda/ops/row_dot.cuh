// One warp's dot product of a weight row (whole blocks of Block) with one activation row: the
// inner loop every matrix kernel shares (matvec, the expert FFN), so they all sum the same terms
// in the same order and a token gets the same bits whichever kernel computed it.
//   exact (kInt8 = false): x is n_cols f32; lane l sums elements l, l + 32, ... of dequant * x.
//   int8 (kInt8 = true):   x is the row's q8 activation blocks; lane l sums the bm_dot_q8
//                          partials of blocks l, l + 32, ...
// Then one warp_sum; every lane returns the total.
#pragma once

#include "ops/common.cuh"

namespace sharpi::cuda {

template <typename Block, bool kInt8>
__device__ inline float warp_row_dot(const Block* __restrict__ row, const void* __restrict__ x,
                                     int64_t n_cols) {
    constexpr int kBlock = BmBlockSize<Block>::value;
    const int lane = threadIdx.x % kWarp;
    float acc = 0.0f;
    if constexpr (kInt8) {
        using Act = typename BmActBlock<Block>::type;
        const Act* xq = static_cast<const Act*>(x);
        for (int64_t ib = lane; ib < n_cols / kBlock; ib += kWarp) acc += bm_dot_q8(row + ib, xq + ib);
    } else {
        const float* xf = static_cast<const float*>(x);
        for (int64_t i = lane; i < n_cols; i += kWarp)
            acc += bm_dequant(row + i / kBlock, static_cast<int>(i % kBlock)) * xf[i];
    }
    return warp_sum(acc);
}

// The int8 path exists for quantized blocks only; the plain types always take the exact path.
template <typename Block, bool kInt8>
constexpr bool row_dot_supported() {
    return !kInt8 || bm_has_int8<Block>();
}

}  // namespace sharpi::cuda
