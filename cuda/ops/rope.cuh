// Rotary position embedding on the device, in place, on the first n_rot dimensions of every head;
// the pairings and the angle as cpu/ops/rope.h states them (normal: (x[2i], x[2i+1]); NeoX:
// (x[i], x[i + n_rot/2]); theta_i = pos * freq_scale * base^(-2i / n_rot)). YaRN is not on the
// device yet: the device forward pass refuses models that need it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace sharpi::cuda {

// x: [n_tokens, n_heads * head_dim] with row stride ld; token t has position pos0 + t.
void launch_rope(float* x, int64_t ld, int64_t n_tokens, int64_t n_heads, int64_t head_dim, int64_t pos0,
                 int64_t n_rot, bool neox, float freq_base, float freq_scale, cudaStream_t stream);

}  // namespace sharpi::cuda
