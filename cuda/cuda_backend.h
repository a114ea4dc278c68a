// The core's only view of the CUDA backend. Implemented by backend.cu in a CUDA build and by
// stub.cpp otherwise, so core code never needs #ifdef SHARPI_WITH_CUDA.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "quant/ggml_type.h"

namespace sharpi::cuda {

// True when the library was built with CUDA and at least one device is usable right now.
bool available();

// Device 0 as the runtime reports it now; present = false (and zeros) without CUDA or a device.
struct DeviceInfo {
    bool present = false;
    std::string name;
    int cc_major = 0, cc_minor = 0;  // compute capability (sm_<major><minor>)
    uint64_t vram_total = 0;         // bytes
    uint64_t vram_free = 0;          // bytes free now (cudaMemGetInfo); used = total - free
};
DeviceInfo device_info();

// One line for logs, `sharpi inspect --device cuda` and the stats: the device, its VRAM total,
// used and free, or why CUDA is unavailable.
std::string describe();

// What device="cuda" would place in VRAM for one session (everything resident: part 1).
struct DeviceRequest {
    std::string arch;
    bool moe = false;  // the model has routed experts
    uint64_t dense_bytes = 0;
    uint64_t expert_bytes = 0;
    uint64_t kv_bytes = 0;
};

// device="cuda": returns when the device forward pass can run the model, else throws a typed
// error naming the reason, checked in this order: DeviceError (no usable device, with the CUDA
// error); UnsupportedError naming the arch (the device path computes the plain MoE archs
// qwen3moe, olmoe and mixtral only); InvalidArgument naming the sizes when dense weights, experts
// and KV cache do not fit the device's free VRAM; UnsupportedError while the device layer loop is
// unwritten. The stub: UnsupportedError (built without CUDA).
void require_device_forward(const DeviceRequest& request);

// ---- op entries for the tests and benchmarks ------------------------------------------------------
// Each uploads its host inputs, runs one op's launch sequence on a fresh stream, waits, and returns
// the result on the host. Shapes as in the op headers under cuda/ops/. Without CUDA or a device
// they throw the typed error require_device_forward would (the stub: UnsupportedError).

std::vector<float> op_dequantize(GgmlType type, const void* data, size_t n_bytes);
std::vector<uint8_t> op_quantize_act(GgmlType weight, const float* x, int64_t n_cols, int64_t n_tokens);
// y [n_tokens, n_rows] = W . x[t]; int8: quantized activations (the tiled matmul when n_tokens > 1
// and tiled, the matvec otherwise).
std::vector<float> op_matmul(GgmlType type, const void* w, size_t w_bytes, int64_t n_rows, int64_t n_cols,
                             const float* x, int64_t n_tokens, bool int8, bool tiled);
std::vector<float> op_rms_norm(const float* x, const float* weight, int64_t n_tokens, int64_t n, float eps);
std::vector<float> op_rope(const float* x, int64_t n_tokens, int64_t n_heads, int64_t head_dim, int64_t pos0,
                           int64_t n_rot, bool neox, float freq_base, float freq_scale);
std::vector<float> op_silu_mul(const float* gate, const float* up, int64_t n);
// ids then weights, each [n_tokens, k], as floats (ids exact: they are < 2^24).
std::vector<float> op_router(const float* logits, int64_t n_tokens, int64_t n_expert, int64_t k,
                             bool normalize);
// k_cache / v_cache: [n_kv, n_head_kv * head_dim] with n_kv = pos0 + n_tokens.
std::vector<float> op_attention(const float* q, const float* k_cache, const float* v_cache, int64_t n_tokens,
                                int64_t pos0, int64_t n_head, int64_t n_head_kv, int64_t head_dim,
                                float scale);
// Stacked expert tensors (file layout) and the routing [n_tokens, k]: grouped = false runs the
// decode kernels once per token, true the grouped prefill path over the whole batch.
struct OpExperts {
    const void* gate;
    size_t gate_bytes;
    const void* up;
    size_t up_bytes;
    const void* down;
    size_t down_bytes;
    GgmlType gate_type, up_type, down_type;
    int64_t n_embd, n_ff, n_expert;
};
std::vector<float> op_expert_ffn(const OpExperts& experts, const float* x, int64_t n_tokens,
                                 const int32_t* ids, const float* weights, int64_t k, bool int8,
                                 bool grouped);

}  // namespace sharpi::cuda
