// Rotary position embedding on the device, in place, on the first n_rot dimensions of every head;
// the pairings and the angle as cpu/ops/rope.h states them (normal: (x[2i], x[2i+1]); NeoX:
// (x[i], x[i + n_rot/2]); theta_i = pos * freq_scale * base^(-2i / n_rot), divided by the file's
// frequency factors where it has them (rope_freqs), YaRN's ramp between the interpolated and the
// extrapolated angle over [corr_low, corr_high] and its mscale on cos and sin).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/op_types.h"

namespace sharpi::cuda {

// RopeParams (backend/op_types.h) with the frequency factors on the device.
struct DeviceRope {
    int64_t n_rot = 0;
    bool neox = false;
    float freq_base = 10000.0f, freq_scale = 1.0f;
    float ext_factor = 0.0f, corr_low = 0.0f, corr_high = 0.0f, mscale = 1.0f;
    const float* freq_factors = nullptr;  // [n_rot / 2] on the device; null: none
};

// p's angle as the kernel takes it, with its frequency factors already on the device (null: none).
DeviceRope device_rope(const RopeParams& p, const float* freq_factors);

// x: [n_tokens, n_heads * head_dim] with row stride ld; token t has position pos0 + t.
void launch_rope(float* x, int64_t ld, int64_t n_tokens, int64_t n_heads, int64_t head_dim, int64_t pos0,
                 const DeviceRope& rope, cudaStream_t stream);

}  // namespace sharpi::cuda
