// Fused routed-expert FFN on the device: out[t] = sum_slot weight[t, slot] * down_e(silu(gate_e x) * up_e x)
// for the k experts e = ids[t, slot] a token selected, summed in slot order (as the CPU does).
//
// Weights are the file's expert-major stacks, resident in VRAM: gate / up: [n_expert, n_ff, n_embd],
// down: [n_expert, n_embd, n_ff], each of its own type (a file may mix them). Decode
// (launch_expert_ffn_decode) is one launch sequence for all k experts of one token, with the
// routing read on the device (no host round trip): gate+up+SiLU·mul in one kernel (a warp computes
// both rows and writes the activation), the down projection for all k experts, then the weighted
// sum. Prefill (launch_expert_ffn_grouped) groups the batch's (token, slot) pairs by expert on the
// host and runs each expert once over all its tokens (the int8 path through the tiled matmul).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "quant/ggml_type.h"

namespace sharpi::cuda {

struct ExpertWeights {
    const void* gate;
    const void* up;
    const void* down;
    GgmlType gate_type, up_type, down_type;
    int64_t n_embd, n_ff;
};

// Device scratch the FFN needs for n_tokens tokens of k slots (bytes), given whether the int8 path runs.
size_t expert_ffn_scratch_bytes(const ExpertWeights& w, int64_t n_tokens, int64_t k, bool int8);

// One token: x [n_embd], ids / weights [k] on the device -> out [n_embd]. scratch: device memory
// of expert_ffn_scratch_bytes(w, 1, k, int8).
void launch_expert_ffn_decode(const ExpertWeights& w, const float* x, const int32_t* ids,
                              const float* weights, int64_t k, bool int8, void* scratch, float* out,
                              cudaStream_t stream);

// A batch: x [n_tokens, n_embd] on the device; ids / weights [n_tokens, k] on the host (the
// grouping is planned on the host) and on the device (weights_dev, for the weighted sum) -> out
// [n_tokens, n_embd]. scratch: expert_ffn_scratch_bytes(w, n_tokens, k, int8).
void launch_expert_ffn_grouped(const ExpertWeights& w, const float* x, int64_t n_tokens,
                               const int32_t* ids_host, const float* weights_dev, int64_t k, bool int8,
                               void* scratch, float* out, cudaStream_t stream);

}  // namespace sharpi::cuda
