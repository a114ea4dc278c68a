// One warp per token: the lanes share the softmax reductions; top-k is k rounds of a warp arg-max
// over the remaining experts (k and n_expert are small: at most a few hundred experts), and lane 0
// computes the k weights in slot order, as the CPU does.
#include "ops/common.cuh"
#include "ops/router.cuh"

namespace sharpi::cuda {
namespace {

constexpr int kMaxExperts = 512;

__global__ void router_kernel(const float* __restrict__ logits, int64_t n_expert, int64_t k,
                              DeviceRouterSpec spec, int32_t* __restrict__ ids, float* __restrict__ weights,
                              float* __restrict__ probs_out) {
    __shared__ float gate[kMaxExperts];  // gating scores
    __shared__ float sel[kMaxExperts];   // what the top-k ranks; -inf once taken
    __shared__ int picked[kMaxExperts];
    const int lane = threadIdx.x;
    const float* lt = logits + static_cast<int64_t>(blockIdx.x) * n_expert;
    if (spec.gating == Gating::softmax) {
        float mx = -INFINITY;
        for (int64_t e = lane; e < n_expert; e += kWarp) mx = fmaxf(mx, lt[e]);
        mx = warp_max(mx);
        float sum = 0.0f;
        for (int64_t e = lane; e < n_expert; e += kWarp) {
            gate[e] = expf(lt[e] - mx);
            sum += gate[e];
        }
        sum = warp_sum(sum);
        for (int64_t e = lane; e < n_expert; e += kWarp) gate[e] /= sum;
    } else if (spec.gating == Gating::sigmoid) {
        for (int64_t e = lane; e < n_expert; e += kWarp) gate[e] = 1.0f / (1.0f + expf(-lt[e]));
    } else {
        // softplus as torch computes it (linear above 20), as cpu/ops/router.cpp.
        for (int64_t e = lane; e < n_expert; e += kWarp)
            gate[e] = sqrtf(lt[e] > 20.0f ? lt[e] : log1pf(expf(lt[e])));
    }
    for (int64_t e = lane; e < n_expert; e += kWarp) {
        const float rank = spec.rank_logits ? lt[e] : gate[e];
        sel[e] = spec.selection_bias != nullptr ? rank + spec.selection_bias[e] : rank;
    }
    if (probs_out != nullptr) {
        for (int64_t e = lane; e < n_expert; e += kWarp) probs_out[blockIdx.x * n_expert + e] = gate[e];
    }
    __syncwarp();
    for (int64_t slot = 0; slot < k; ++slot) {
        float best = -INFINITY;
        int best_id = kMaxExperts;
        for (int64_t e = lane; e < n_expert; e += kWarp) {
            if (sel[e] > best) {  // strict: within a lane the lower id wins ties
                best = sel[e];
                best_id = static_cast<int>(e);
            }
        }
        for (int offset = kWarp / 2; offset > 0; offset /= 2) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, offset);
            const int oi = __shfl_xor_sync(0xffffffffu, best_id, offset);
            if (ob > best || (ob == best && oi < best_id)) {
                best = ob;
                best_id = oi;
            }
        }
        // Only NaN scores leave no winner; expert 0 then keeps every index in range.
        if (best_id >= n_expert) best_id = 0;
        if (lane == 0) {
            picked[slot] = best_id;
            ids[blockIdx.x * k + slot] = best_id;
            sel[best_id] = -INFINITY;  // taken
        }
        __syncwarp();
    }
    if (lane == 0) {
        float wsum = 0.0f;
        for (int64_t slot = 0; slot < k; ++slot) wsum += gate[picked[slot]];
        for (int64_t slot = 0; slot < k; ++slot) {
            const float w = spec.normalize ? gate[picked[slot]] / wsum : gate[picked[slot]];
            weights[blockIdx.x * k + slot] = spec.scale == 1.0f ? w : w * spec.scale;
        }
    }
}

}  // namespace

void launch_router_topk(const float* logits, int64_t n_tokens, int64_t n_expert, int64_t k,
                        const DeviceRouterSpec& spec, int32_t* ids, float* weights, cudaStream_t stream,
                        float* probs) {
    if (n_expert > kMaxExperts || k > n_expert || k <= 0) {
        throw UnsupportedError(
            "[cuda] router: n_expert=" + std::to_string(n_expert) + ", k=" + std::to_string(k) +
            " (the device router takes 1 <= k <= n_expert <= " + std::to_string(kMaxExperts) + ")");
    }
    if (n_tokens <= 0) return;
    router_kernel<<<static_cast<unsigned int>(n_tokens), kWarp, 0, stream>>>(logits, n_expert, k, spec, ids,
                                                                             weights, probs);
    SHARPI_CUDA_CHECK_LAUNCH("router");
}

}  // namespace sharpi::cuda
