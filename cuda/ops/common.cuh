// Shared by the kernels under cuda/ops/: warp reductions, launch helpers, and the type dispatch
// of host launch code (bm_dispatch of block_math.cuh). Every launch function takes a stream and
// queues work on it without synchronizing; shapes are in elements, rows contiguous.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "block_math.cuh"
#include "cuda_check.cuh"

namespace sharpi::cuda {

constexpr int kWarp = 32;

__device__ inline float warp_sum(float v) {
    for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ inline float warp_max(float v) {
    for (int offset = kWarp / 2; offset > 0; offset /= 2)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024); every thread gets it.
__device__ inline float block_sum(float v) {
    __shared__ float partial[kWarp];
    const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
    v = warp_sum(v);
    __syncthreads();  // partial[] may still be read by a previous call
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int n_warps = static_cast<int>(blockDim.x) / kWarp;
    v = lane < n_warps ? partial[lane] : 0.0f;
    return warp_sum(v);
}

inline unsigned int div_up(int64_t a, int64_t b) {
    return static_cast<unsigned int>((a + b - 1) / b);
}

// The block struct behind a bm_dispatch tag.
template <typename Tag>
using BlockOf = std::remove_cv_t<std::remove_pointer_t<Tag>>;

// bm_dispatch, throwing UnsupportedError for a type without block math.
template <typename F>
void dispatch_type(GgmlType type, const char* op, F&& f) {
    if (!bm_dispatch(type, f)) {
        throw UnsupportedError(std::string("[cuda] ") + op + ": no kernel for type " +
                               ggml_type_traits(type).name);
    }
}

}  // namespace sharpi::cuda
