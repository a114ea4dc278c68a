// The activation arena of the device forward pass: one device allocation carved into the buffers a
// batch of up to max_batch tokens needs, the same layout for the planner (plan_device_model, host
// arithmetic in every build) and the forward pass (device_forward.cu), so the VRAM the planner
// charges is the VRAM the forward pass takes. Offsets in bytes, every buffer 256-byte aligned.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "model/hparams.h"
#include "quant/ggml_type.h"

namespace sharpi {
struct Model;
}  // namespace sharpi

namespace sharpi::cuda {

// One tensor the device forward pass reads, as the loaded model holds it on the host: a weight view's
// bytes in the file type, or a 1-D f32 vector the loader made (norms, biases). data identifies it:
// the forward pass finds a weight's device copy by the host address of the model's own view.
struct HostWeight {
    std::string name;
    GgmlType type = GgmlType::F32;
    const void* data = nullptr;
    uint64_t bytes = 0;
    bool expert = false;
};

// Every tensor the layer builders read, each once (a tied output head is token_embd), in upload
// order: what device_forward.cu and the CUDA backend (cuda_backend.cuh) upload.
std::vector<HostWeight> device_weights(const Model& model);

struct DeviceArena {
    // [max_batch, width] f32 activations
    size_t x = 0;           // residual stream, n_embd
    size_t cur = 0;         // normed input of a block, n_embd
    size_t q = 0;           // query, n_embd_q
    size_t attn = 0;        // attention output before attn_output, n_embd_q
    size_t tmp = 0;         // a block's output before the residual add, n_embd
    size_t ffn_inp = 0;     // residual after attention, n_embd
    size_t ffn_out = 0;     // shared expert / dense FFN output, n_embd
    size_t router = 0;      // router logits, n_expert
    size_t ids = 0;         // [max_batch, k] int32 expert ids
    size_t weights = 0;     // [max_batch, k] f32 expert weights
    size_t ffn_g = 0;       // dense / shared FFN gate rows, n_ff_dense
    size_t ffn_u = 0;       // dense / shared FFN up rows (then silu(g) * u), n_ff_dense
    size_t shexp_gate = 0;  // [max_batch] shared-expert gate logit
    size_t xq = 0;          // q8 activations of any dense product's input (int8 path)
    size_t experts = 0;     // the fused expert FFN's scratch (expert_ffn_scratch_bytes)
    size_t logits = 0;      // [max_batch, n_vocab] f32
    size_t routing = 0;     // [n_layer, max_batch, k] int32: every layer's ids, copied back once
    size_t expert_scratch_bytes = 0;
    size_t total = 0;
};

// Bytes of one row of q8 activations for n f32 elements, an upper bound over the three activation
// formats (q8_0: 34 B / 32, q8_1: 36 B / 32, q8_K: 292 B / 256).
inline size_t q8_act_row_bound(int64_t n) {
    return static_cast<size_t>((n + 255) / 256) * 292;
}

// n_ff_dense: the widest dense FFN a layer runs (qwen2moe's shared expert; 0 without one).
// The expert scratch is the bound of expert_ffn_scratch_bytes (cuda/ops/expert_ffn.cu's carve)
// with every q8 row at q8_act_row_bound; the forward pass checks the real size against it.
DeviceArena device_arena(const HParams& h, int64_t max_batch, int64_t n_ff_dense);

}  // namespace sharpi::cuda
