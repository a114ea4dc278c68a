// One warp per token: the lanes share the softmax reductions; top-k is k rounds of a warp
// arg-max over the remaining experts (k and n_expert are small: at most a few hundred experts).
#include "ops/common.cuh"
#include "ops/router.cuh"

namespace sharpi::cuda {
namespace {

constexpr int kMaxExperts = 512;

__global__ void router_kernel(const float* __restrict__ logits, int64_t n_expert, int64_t k, bool normalize,
                              int32_t* __restrict__ ids, float* __restrict__ weights,
                              float* __restrict__ probs_out) {
    __shared__ float probs[kMaxExperts];
    const int lane = threadIdx.x;
    const float* lt = logits + static_cast<int64_t>(blockIdx.x) * n_expert;
    float mx = -INFINITY;
    for (int64_t e = lane; e < n_expert; e += kWarp) mx = fmaxf(mx, lt[e]);
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int64_t e = lane; e < n_expert; e += kWarp) {
        probs[e] = expf(lt[e] - mx);
        sum += probs[e];
    }
    sum = warp_sum(sum);
    for (int64_t e = lane; e < n_expert; e += kWarp) probs[e] /= sum;
    if (probs_out != nullptr) {
        for (int64_t e = lane; e < n_expert; e += kWarp) probs_out[blockIdx.x * n_expert + e] = probs[e];
    }
    __syncwarp();
    float picked_sum = 0.0f;
    for (int64_t slot = 0; slot < k; ++slot) {
        float best = -1.0f;
        int best_id = kMaxExperts;
        for (int64_t e = lane; e < n_expert; e += kWarp) {
            if (probs[e] > best) {  // strict: within a lane the lower id wins ties
                best = probs[e];
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
        if (lane == 0) {
            ids[blockIdx.x * k + slot] = best_id;
            weights[blockIdx.x * k + slot] = best;
            probs[best_id] = -1.0f;  // taken
        }
        picked_sum += best;
        __syncwarp();
    }
    if (normalize && lane == 0) {
        for (int64_t slot = 0; slot < k; ++slot) weights[blockIdx.x * k + slot] /= picked_sum;
    }
}

}  // namespace

void launch_router_softmax_topk(const float* logits, int64_t n_tokens, int64_t n_expert, int64_t k,
                                bool normalize, int32_t* ids, float* weights, cudaStream_t stream,
                                float* probs) {
    if (n_expert > kMaxExperts || k > n_expert || k <= 0) {
        throw UnsupportedError(
            "[cuda] router: n_expert=" + std::to_string(n_expert) + ", k=" + std::to_string(k) +
            " (the device router takes 1 <= k <= n_expert <= " + std::to_string(kMaxExperts) + ")");
    }
    if (n_tokens <= 0) return;
    router_kernel<<<static_cast<unsigned int>(n_tokens), kWarp, 0, stream>>>(logits, n_expert, k, normalize,
                                                                             ids, weights, probs);
    SHARPI_CUDA_CHECK_LAUNCH("router");
}

}  // namespace sharpi::cuda
