// One thread block of kWarps warps per (head, token). Warp w walks positions w, w + kWarps, ...
// with an online softmax (running max m, running sum l, running output acc, each lane holding
// head_dim / 32 dimensions); the warps' partial states are merged at the end in warp order, so the
// result does not depend on scheduling.
#include "ops/attention.cuh"
#include "ops/common.cuh"

namespace sharpi::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kDimsPerLane = static_cast<int>(kMaxAttentionHeadDim / kWarp);

__global__ void attention_kernel(const float* __restrict__ q, const float* __restrict__ k_cache,
                                 const float* __restrict__ v_cache, int64_t pos0, int64_t n_head,
                                 int64_t n_head_kv, int64_t head_dim, float scale,
                                 DeviceAttentionLimits limits, float* __restrict__ out) {
    __shared__ float s_acc[kWarps][kMaxAttentionHeadDim];
    __shared__ float s_m[kWarps], s_l[kWarps];
    const int64_t head = blockIdx.x, t = blockIdx.y;
    const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
    const int64_t kv_head = head / (n_head / n_head_kv);
    const int64_t kv_ld = n_head_kv * head_dim;
    const float* qh = q + t * n_head * head_dim + head * head_dim;

    float qv[kDimsPerLane], acc[kDimsPerLane];
    for (int j = 0; j < kDimsPerLane; ++j) {
        const int64_t d = static_cast<int64_t>(j) * kWarp + lane;
        qv[j] = d < head_dim ? qh[d] * scale : 0.0f;
        acc[j] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    const int64_t pos = pos0 + t, n_pos = pos + 1;
    int64_t first = 0;
    if (limits.window > 0 && pos - limits.window + 1 > first) first = pos - limits.window + 1;
    if (limits.chunk > 0 && pos / limits.chunk * limits.chunk > first)
        first = pos / limits.chunk * limits.chunk;
    for (int64_t p = first + warp; p < n_pos; p += kWarps) {
        const float* kp = k_cache + p * kv_ld + kv_head * head_dim;
        const float* vp = v_cache + p * kv_ld + kv_head * head_dim;
        float s = 0.0f;
        for (int j = 0; j < kDimsPerLane; ++j) {
            const int64_t d = static_cast<int64_t>(j) * kWarp + lane;
            if (d < head_dim) s += qv[j] * kp[d];
        }
        s = warp_sum(s);
        const float m_new = fmaxf(m, s);
        const float old_scale = expf(m - m_new), w = expf(s - m_new);
        l = l * old_scale + w;
        for (int j = 0; j < kDimsPerLane; ++j) {
            const int64_t d = static_cast<int64_t>(j) * kWarp + lane;
            if (d < head_dim) acc[j] = acc[j] * old_scale + w * vp[d];
        }
        m = m_new;
    }
    for (int j = 0; j < kDimsPerLane; ++j) {
        const int64_t d = static_cast<int64_t>(j) * kWarp + lane;
        if (d < head_dim) s_acc[warp][d] = acc[j];
    }
    if (lane == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
    }
    __syncthreads();
    // The sink joins the denominator as one more logit with no value row.
    const float sink = limits.sinks != nullptr ? limits.sinks[head] : -INFINITY;
    float m_all = sink;
    for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, s_m[w]);
    float l_all = limits.sinks != nullptr ? expf(sink - m_all) : 0.0f;
    for (int w = 0; w < kWarps; ++w) {
        if (s_l[w] > 0.0f) l_all += s_l[w] * expf(s_m[w] - m_all);
    }
    float* oh = out + t * n_head * head_dim + head * head_dim;
    for (int64_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < kWarps; ++w) {
            if (s_l[w] > 0.0f) o += s_acc[w][d] * expf(s_m[w] - m_all);
        }
        oh[d] = o / l_all;
    }
}

}  // namespace

void launch_attention(const float* q, const float* k_cache, const float* v_cache, int64_t n_tokens,
                      int64_t pos0, int64_t n_head, int64_t n_head_kv, int64_t head_dim, float scale,
                      float* out, cudaStream_t stream, const DeviceAttentionLimits& limits) {
    if (head_dim > kMaxAttentionHeadDim || n_head_kv <= 0 || n_head % n_head_kv != 0) {
        throw UnsupportedError(
            "[cuda] attention: head_dim=" + std::to_string(head_dim) + ", n_head=" + std::to_string(n_head) +
            ", n_head_kv=" + std::to_string(n_head_kv) + " (the device kernel takes head_dim <= " +
            std::to_string(kMaxAttentionHeadDim) + " and n_head a multiple of n_head_kv)");
    }
    if (n_tokens <= 0) return;
    const dim3 grid(static_cast<unsigned int>(n_head), static_cast<unsigned int>(n_tokens));
    attention_kernel<<<grid, kWarps * kWarp, 0, stream>>>(q, k_cache, v_cache, pos0, n_head, n_head_kv,
                                                          head_dim, scale, limits, out);
    SHARPI_CUDA_CHECK_LAUNCH("attention");
}

}  // namespace sharpi::cuda
