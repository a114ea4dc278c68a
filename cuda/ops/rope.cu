// One thread per rotated pair. The angle is computed in double (pow, sincos) and rounded once, so
// it matches the CPU's to within one f32 rounding whatever the position; YaRN's mix and mscale in
// cpu/ops/rope.cpp's order.
#include "ops/common.cuh"
#include "ops/rope.cuh"

namespace sharpi::cuda {
namespace {

__global__ void rope_kernel(float* x, int64_t ld, int64_t n_tokens, int64_t n_heads, int64_t head_dim,
                            int64_t pos0, DeviceRope r) {
    const int64_t half = r.n_rot / 2;
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= n_tokens * n_heads * half) return;
    const int64_t i = idx % half;
    const int64_t head = (idx / half) % n_heads;
    const int64_t t = idx / (half * n_heads);
    double inv_freq =
        pow(static_cast<double>(r.freq_base), -2.0 * static_cast<double>(i) / static_cast<double>(r.n_rot));
    if (r.freq_factors != nullptr) inv_freq /= r.freq_factors[i];
    const double pos_extrap = static_cast<double>(pos0 + t);
    double theta = pos_extrap * static_cast<double>(r.freq_scale) * inv_freq;
    if (r.ext_factor != 0.0f) {
        const double y = (static_cast<double>(i) - r.corr_low) /
                         fmax(0.001, static_cast<double>(r.corr_high) - static_cast<double>(r.corr_low));
        const double mix = (1.0 - fmin(1.0, fmax(0.0, y))) * r.ext_factor;
        theta = theta * (1.0 - mix) + pos_extrap * inv_freq * mix;
    }
    double s, c;
    sincos(theta, &s, &c);
    const float cs = static_cast<float>(c * r.mscale), sn = static_cast<float>(s * r.mscale);
    float* h = x + t * ld + head * head_dim;
    const int64_t a = r.neox ? i : 2 * i;
    const int64_t b = r.neox ? i + half : 2 * i + 1;
    const float x0 = h[a], x1 = h[b];
    h[a] = x0 * cs - x1 * sn;
    h[b] = x0 * sn + x1 * cs;
}

}  // namespace

DeviceRope device_rope(const RopeParams& p, const float* freq_factors) {
    DeviceRope r;
    r.n_rot = p.n_rot;
    r.neox = p.type == RopeType::neox;
    r.freq_base = p.freq_base;
    r.freq_scale = p.freq_scale;
    r.ext_factor = p.ext_factor;
    r.corr_low = p.corr_low;
    r.corr_high = p.corr_high;
    r.mscale = p.mscale;
    r.freq_factors = freq_factors;
    return r;
}

void launch_rope(float* x, int64_t ld, int64_t n_tokens, int64_t n_heads, int64_t head_dim, int64_t pos0,
                 const DeviceRope& rope, cudaStream_t stream) {
    const int64_t n = n_tokens * n_heads * (rope.n_rot / 2);
    if (n <= 0) return;
    rope_kernel<<<div_up(n, 256), 256, 0, stream>>>(x, ld, n_tokens, n_heads, head_dim, pos0, rope);
    SHARPI_CUDA_CHECK_LAUNCH("rope");
}

}  // namespace sharpi::cuda
