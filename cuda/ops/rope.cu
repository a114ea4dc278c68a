// One thread per rotated pair. The angle is computed in double (pow, sincos) and rounded once, so
// it matches the CPU's to within one f32 rounding whatever the position.
#include "ops/common.cuh"
#include "ops/rope.cuh"

namespace sharpi::cuda {
namespace {

__global__ void rope_kernel(float* x, int64_t ld, int64_t n_tokens, int64_t n_heads, int64_t head_dim,
                            int64_t pos0, int64_t n_rot, bool neox, float freq_base, float freq_scale) {
    const int64_t half = n_rot / 2;
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= n_tokens * n_heads * half) return;
    const int64_t i = idx % half;
    const int64_t head = (idx / half) % n_heads;
    const int64_t t = idx / (half * n_heads);
    const double theta =
        static_cast<double>(pos0 + t) * static_cast<double>(freq_scale) *
        pow(static_cast<double>(freq_base), -2.0 * static_cast<double>(i) / static_cast<double>(n_rot));
    double s, c;
    sincos(theta, &s, &c);
    const float cs = static_cast<float>(c), sn = static_cast<float>(s);
    float* h = x + t * ld + head * head_dim;
    const int64_t a = neox ? i : 2 * i;
    const int64_t b = neox ? i + half : 2 * i + 1;
    const float x0 = h[a], x1 = h[b];
    h[a] = x0 * cs - x1 * sn;
    h[b] = x0 * sn + x1 * cs;
}

}  // namespace

void launch_rope(float* x, int64_t ld, int64_t n_tokens, int64_t n_heads, int64_t head_dim, int64_t pos0,
                 int64_t n_rot, bool neox, float freq_base, float freq_scale, cudaStream_t stream) {
    const int64_t n = n_tokens * n_heads * (n_rot / 2);
    if (n <= 0) return;
    rope_kernel<<<div_up(n, 256), 256, 0, stream>>>(x, ld, n_tokens, n_heads, head_dim, pos0, n_rot, neox,
                                                    freq_base, freq_scale);
    SHARPI_CUDA_CHECK_LAUNCH("rope");
}

}  // namespace sharpi::cuda
