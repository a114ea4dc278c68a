// The core's only view of the CUDA backend. Declared here in the core and implemented in cuda/ (by
// backend.cu and its neighbours in a CUDA build, by stub.cpp otherwise), so the dependency runs one
// way, core code never needs #ifdef SHARPI_WITH_CUDA, and nothing in cpp/src includes a cuda/ header.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/op_call.h"
#include "quant/ggml_type.h"
#include "sharpi/types.h"

namespace sharpi {
class Backend;
struct Model;
class ExpertCache;
struct ExpertCacheOptions;
class GateObserver;
struct CpuMissOptions;
struct ExpertCacheStats;
class Timeline;
}  // namespace sharpi

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
// used and free, or why CUDA is unavailable: "no CUDA device" (with "(no NVIDIA driver)" when none is
// installed), the runtime's error only for a driver that is there and fails, or the stub's reason.
std::string describe();

// ---- the CUDA backend's ops (cuda/op_support.cpp; host code, the same in every build) ----------------
//
// Empty when the kernels of cuda/ops run `call` (an op of backend/backend.h as RecordingBackend
// records it); otherwise what stops it: "<op> (<type>[, <variant>]): <reason>", the text of the
// UnsupportedError a device backend gives for it.
std::string unsupported_op(const OpCall& call);
// The Backend ops cuda/ops has kernels for (some variants and types excepted: unsupported_op).
std::vector<std::string> implemented_ops();

// ---- the CUDA backend (cuda/cuda_backend.cuh) -------------------------------------------------------
//
// backend/backend.h's ops on the device, so the layer builders run there: uploads every tensor of
// the model's layers to VRAM (one allocation, the file's types) before returning, and keeps its own
// f32 KV cache on the device (the KvCache the ops are handed gives only its shape; its host buffers
// are never read or written). Every op the support table (unsupported_op) refuses throws
// UnsupportedError "[cuda] <op> (<type>[, <variant>]): <reason>" before anything is queued.
// DeviceError without a usable device. The model must outlive the backend. The stub: UnsupportedError.
std::unique_ptr<Backend> make_cuda_backend(const Model& model);

// ---- the device forward pass (device="cuda") -------------------------------------------------------
//
// What device="cuda" places in VRAM for one session (part 1: everything resident): every weight
// tensor the layer loop reads, uploaded once at load in its file type (quantized as in the file,
// dense and stacked experts alike; norms and biases as the f32 the loader made of them), the f32
// KV cache of n_ctx positions, and the activation buffers of one batch of max_batch tokens.
struct DeviceUpload {
    std::string name;  // tensor name as in the file ("blk.3.ffn_up_exps.weight")
    GgmlType type = GgmlType::F32;
    uint64_t bytes = 0;
    bool expert = false;  // a stacked routed-expert tensor
};

struct DevicePlan {
    std::string arch;
    std::vector<DeviceUpload> uploads;  // in upload order; a tied output head is uploaded once
    uint64_t dense_bytes = 0;           // sum of the uploads that are not experts
    uint64_t expert_bytes = 0;          // sum of the expert uploads
    uint64_t kv_bytes = 0;              // 2 * n_layer * n_ctx * n_embd_kv f32
    uint64_t buffer_bytes = 0;          // activations, routing, scratch, logits of one batch + alignment
    int64_t n_ctx = 0;
    int64_t max_batch = 0;
    int64_t n_ff_dense = 0;  // widest dense FFN (qwen2moe's shared expert), 0 without one
    uint64_t total_bytes() const { return dense_bytes + expert_bytes + kv_bytes + buffer_bytes; }
};

// The device path's own limits, checked by plan_device_model (host arithmetic only, no device
// touched, so the host tests run it in every build) BEFORE anything is allocated. UnsupportedError
// naming what: an arch other than the plain MoE ones (qwen3moe, qwen2moe, olmoe, llama with experts,
// i.e. Mixtral); a router other than softmax top-k (sigmoid gating, expert groups, selection bias,
// a weight scale, router or expert biases); YaRN RoPE; gated / sliding-window / sink attention,
// recurrent layers or MLA; head_dim above the attention kernel's 256; more than 512 experts; a
// tensor type without device block math (MXFP4, the IQ types); a KV cache type other than f32.
// type_k / type_v: the types the session asked for (F32 when the user named none).
DevicePlan plan_device_model(const Model& model, int64_t n_ctx, int64_t max_batch, GgmlType type_k,
                             GgmlType type_v);

// The forward pass of one session on the device. Owns the device copy of the weights, the KV cache,
// the activation buffers and one compute stream; every op of a batch is queued on that stream and
// the host waits once per batch (on the logits copy; a prefill batch also once per MoE layer, to
// group its tokens by expert on the host). Single-threaded like Engine.
class DeviceForward {
  public:
    virtual ~DeviceForward() = default;
    // Tokens at positions pos0 .. pos0 + n_tokens - 1 (the caller checked ids and context); writes
    // the logits of every token (all_logits) or of the last one ([n_vocab] floats each) and each
    // MoE layer's expert ids [n_tokens * k] in rank order to routing[il] (empty for a dense layer).
    // Positions at or past pos0 in the KV cache are overwritten; positions before it are read, never
    // written. check_cancel(il) runs before each layer is queued and may throw (the work already
    // queued completes; nothing is read back). observer (streamed experts, one token only; may be
    // null): on_gate(il, 1, ffn_inp [n_embd], router logits [n_expert], ids [k]) for each MoE layer,
    // after its experts were acquired (so the prefetches it starts queue behind the layer's demand).
    virtual void forward(const int32_t* tokens, int64_t n_tokens, int64_t pos0, bool all_logits,
                         float* logits, std::vector<std::vector<int32_t>>& routing,
                         const std::function<void(int)>& check_cancel, GateObserver* observer) = 0;
    virtual const DevicePlan& plan() const = 0;
    // The VRAM tier of the expert cache when the experts stream (its stats, the prefetcher's target);
    // nullptr when every expert is resident.
    virtual ExpertCache* expert_cache() { return nullptr; }
    // CPU compute of misses: adds its counter and the cost model's inputs to `st` (nothing resident).
    virtual void add_miss_stats(ExpertCacheStats& st) const {}
    // An enabled timeline (it outlives the forward pass) gets a "compute stream" span per layer and
    // pass and, with streamed experts, a "copy stream" span per expert fill, in device times placed on
    // the timeline's clock. Takes a reference point (one device wait); a disabled one is ignored.
    virtual void set_timeline(Timeline* timeline) {}
};

// device="cuda": checks, in this order, and throws before allocating anything: DeviceError (no
// usable device, with the CUDA error string); plan_device_model's UnsupportedError; InvalidArgument
// naming the sizes when the plan does not fit the device's free VRAM. Then uploads the weights
// (one compute stream, waited on before returning) and returns the ready forward pass. exact: f32
// activations on dequantized weights in every product; otherwise the int8 paths on q8-quantized
// activations for every quantized weight (as the CPU's fast mode). The stub: UnsupportedError.
// streamed: nullptr uploads every expert (part 1, "resident"); otherwise the routed experts stay in
// the model's mapping (registered as pinned) and reach VRAM through an ExpertCache in the VRAM tier
// with these options (n_slots, n_staging, policy; the tier planner chose the sizes): each MoE layer
// reads its ids back to the host once, acquires its experts, makes the compute stream wait on exactly
// those experts' copy events and runs the same expert kernels through a slot table, so the logits are
// the resident ones bit for bit. The VRAM check then charges the slots instead of the experts.
// misses (streamed only; nullptr: every miss copied): CPU compute of misses (moe/cpu_miss.h). In
// single-token decoding a selected expert that is neither in VRAM nor loading is, by the mode, copied
// or computed on the CPU from the mapping with the CPU kernels (one activation row down, one output
// row up, added in slot order by the same weighted sum); the cost model's inputs are measured here
// when not given. Prefill batches always copy (the model charges the CPU per row).
std::unique_ptr<DeviceForward> open_device_forward(const Model& model, int64_t n_ctx, int64_t max_batch,
                                                   GgmlType type_k, GgmlType type_v, bool exact,
                                                   const ExpertCacheOptions* streamed = nullptr,
                                                   const CpuMissOptions* misses = nullptr);

// ---- op entries for the tests and benchmarks ------------------------------------------------------
// Each uploads its host inputs, runs one op's launch sequence on a fresh stream, waits, and returns
// the result on the host. Shapes as in the op headers under cuda/ops/. Without CUDA or a device
// they throw the typed error open_device_forward would (the stub: UnsupportedError).

std::vector<float> op_dequantize(GgmlType type, const void* data, size_t n_bytes);
std::vector<uint8_t> op_quantize_act(GgmlType weight, const float* x, int64_t n_cols, int64_t n_tokens);
// y [n_tokens, n_rows] = W . x[t]; int8: quantized activations (the tiled matmul when n_tokens > 1
// and tiled, the matvec otherwise).
std::vector<float> op_matmul(GgmlType type, const void* w, size_t w_bytes, int64_t n_rows, int64_t n_cols,
                             const float* x, int64_t n_tokens, bool int8, bool tiled);
std::vector<float> op_rms_norm(const float* x, const float* weight, int64_t n_tokens, int64_t n, float eps);
// p: the angle's parameters (freq_base, freq_scale, YaRN, freq_factors: host [n_rot / 2] or null).
std::vector<float> op_rope(const float* x, int64_t n_tokens, int64_t n_heads, int64_t head_dim, int64_t pos0,
                           int64_t n_rot, bool neox, const RopeParams& p);
std::vector<float> op_silu_mul(const float* gate, const float* up, int64_t n);
// ids then weights, each [n_tokens, k], as floats (ids exact: they are < 2^24). params as the
// CPU's route_topk takes them (selection_bias a host array of n_expert; no expert groups).
std::vector<float> op_router(const float* logits, int64_t n_tokens, int64_t n_expert, int64_t k,
                             const RouterParams& params);
// k_cache / v_cache: [n_kv, n_head_kv * head_dim] with n_kv = pos0 + n_tokens.
// window / chunk / sinks (host [n_head], may be null) as AttentionShape's.
std::vector<float> op_attention(const float* q, const float* k_cache, const float* v_cache, int64_t n_tokens,
                                int64_t pos0, int64_t n_head, int64_t n_head_kv, int64_t head_dim,
                                float scale, int64_t window, int64_t chunk, const float* sinks);
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
    // The activation and stacked biases of ExpertFfnWeights (host [n_expert, n_ff] / [n_expert,
    // n_embd], null: none): relu_sqr, else swiglu_clamp (DeepSeek-V4), else swiglu_limit (gpt-oss).
    bool relu_sqr = false;
    float swiglu_clamp = 0.0f, swiglu_limit = 0.0f;
    const float* gate_b = nullptr;
    const float* up_b = nullptr;
    const float* down_b = nullptr;
};
std::vector<float> op_expert_ffn(const OpExperts& experts, const float* x, int64_t n_tokens,
                                 const int32_t* ids, const float* weights, int64_t k, bool int8,
                                 bool grouped);

// ---- the VRAM tier of the expert cache (device_tier.cu) -----------------------------------------
// ExpertCache in the "vram" tier (moe/expert_tier.h): slots in device memory, filled from the model's
// mapped (and pinned) file on a copy stream, one event per copy; compute waits on a slot's events.
// op_vram_tier_run drives it as the MoE layer loop does, step by step (gate, acquire, the compute
// stream waits on exactly the acquired slots' copies and reads every slot back to the host, release),
// prefetching after each step what the step names, then settling the fills (drain) so the counters
// compare with the other tiers'. DeviceError without a device; the stub: UnsupportedError.
struct TierStep {
    int32_t layer = 0;
    std::vector<int32_t> experts;                             // unique ids the gate selected
    std::vector<std::pair<int32_t, int32_t>> prefetch_after;  // (layer, expert) prefetched after the step
};
struct VramTierOptions {
    uint64_t n_slots = 0;
    uint64_t n_staging = 0;
    std::string policy = "slru";
    std::string reader = "auto";  // the fill source (device_tier.cuh's vram_tier): "auto", "cufile", ...
};
struct VramTierRun {
    std::vector<std::vector<std::string>> bytes;  // [step][expert]: gate | up | down read back from VRAM
    ExpertCacheStats stats;
};
VramTierRun op_vram_tier_run(const Model& model, const VramTierOptions& options,
                             const std::vector<TierStep>& steps);

}  // namespace sharpi::cuda
