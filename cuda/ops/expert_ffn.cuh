// Fused routed-expert FFN on the device: out[t] = sum_slot weight[t, slot] * down_e(act(gate_e x, up_e x))
// for the k experts e = ids[t, slot] a token selected, summed in slot order (as the CPU does). act is
// SiLU(gate) * up, or an expert variant (ops/activation.cuh: gpt-oss's and DeepSeek-V4's clamped
// SwiGLU, Nemotron-H's ungated relu^2 of up, whose gate rows are never read); experts with biases
// (gpt-oss) add them to the gate, up and down products as cpu/ops/expert_ffn.cpp does (stacked
// beside the stacked weights, or per slot in a slot table).
//
// Weights are the file's expert-major stacks, resident in VRAM: gate / up: [n_expert, n_ff, n_embd],
// down: [n_expert, n_embd, n_ff], each of its own type (a file may mix them). Decode
// (launch_expert_ffn_decode) is one launch sequence for all k experts of one token, with the
// routing read on the device (no host round trip): gate+up+SiLU·mul in one kernel (a warp computes
// both rows and writes the activation), the down projection for all k experts, then the weighted
// sum. Prefill (launch_expert_ffn_grouped) groups the batch's (token, slot) pairs by expert on the
// host and runs each expert once over all its tokens (the int8 path through the tiled matmul).
//
// Streamed experts (the VRAM tier, cuda/device_tier.cu) are not stacked: each selected expert's
// parts sit in a cache slot. The same kernels then read each slot's rows through a slot table (one
// device pointer per selected expert and part, passed by value in the launch), and the grouped path
// takes one expert at a time with its slot's pointers (GroupedExpertFfn), so the cache can hand the
// experts over in waves. The arithmetic and its order do not depend on where the rows are: resident
// and streamed outputs are equal bit for bit.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "ops/activation.cuh"
#include "quant/ggml_type.h"

namespace sharpi::cuda {

struct ExpertWeights {
    const void* gate;
    const void* up;
    const void* down;
    GgmlType gate_type, up_type, down_type;
    int64_t n_embd, n_ff;
    ExpertActivation act{};
    // Stacked expert biases on the device ([n_expert, n_ff], [n_expert, n_ff], [n_expert, n_embd]),
    // null where the experts have none; the stacked decode and grouped paths read expert e's row.
    const float* gate_b = nullptr;
    const float* up_b = nullptr;
    const float* down_b = nullptr;
};

// The most experts one token selects that a slot table holds (the decode launch passes it by value).
constexpr int kMaxSlotTable = 32;

// Device pointers to the parts of each selected expert, in rank order (slot s: the expert of
// ids[s]); the types and shapes are an ExpertWeights' (whose stacked pointers are then unused).
// CPU compute of misses: a slot whose bit is set in cpu_mask was computed on the host; the kernels
// skip it (its pointers are not read) and its unweighted output row, cpu_rows[s * n_embd ..] (pinned
// host memory, unchanged until the stream passes this launch), is copied in before the weighted sum.
struct ExpertSlotTable {
    const void* gate[kMaxSlotTable];
    const void* up[kMaxSlotTable];
    const void* down[kMaxSlotTable];
    // Each slot's expert biases ([n_ff], [n_ff], [n_embd] on the device), null where it has none.
    const float* gate_b[kMaxSlotTable];
    const float* up_b[kMaxSlotTable];
    const float* down_b[kMaxSlotTable];
    uint32_t cpu_mask;
    const float* cpu_rows;
};

// Device scratch the FFN needs for n_tokens tokens of k slots (bytes), given whether the int8 path runs.
size_t expert_ffn_scratch_bytes(const ExpertWeights& w, int64_t n_tokens, int64_t k, bool int8);

// One token: x [n_embd], ids / weights [k] on the device -> out [n_embd]. scratch: device memory
// of expert_ffn_scratch_bytes(w, 1, k, int8).
void launch_expert_ffn_decode(const ExpertWeights& w, const float* x, const int32_t* ids,
                              const float* weights, int64_t k, bool int8, void* scratch, float* out,
                              cudaStream_t stream);

// One token with its experts in cache slots: slots.{gate,up,down}[s] for s < k (k <= kMaxSlotTable;
// the same launches and order as launch_expert_ffn_decode, so the same bits).
void launch_expert_ffn_decode_slots(const ExpertWeights& w, const ExpertSlotTable& slots, const float* x,
                                    const float* weights, int64_t k, bool int8, void* scratch, float* out,
                                    cudaStream_t stream);

// The grouped path in steps: the constructor groups the (token, slot) rows by expert on the host
// and gathers each group's input rows; run_expert(e, ...) computes expert e's group from weights at
// the given device pointers (once per listed expert, in any order: each writes its own rows); combine
// then forms the weighted sums in slot order. All queued on `stream`; scratch as for the batch.
class GroupedExpertFfn {
  public:
    GroupedExpertFfn(const ExpertWeights& w, const float* x, int64_t n_tokens, const int32_t* ids_host,
                     int64_t k, bool int8, void* scratch, cudaStream_t stream);
    // The distinct experts the batch selected, in increasing id order.
    const std::vector<int32_t>& experts() const { return experts_; }
    void run_expert(int32_t e, const void* gate, const void* up, const void* down);
    void combine(const float* weights_dev, float* out);

  private:
    ExpertWeights w_;
    int64_t n_tokens_, k_;
    bool int8_;
    void* scratch_;
    cudaStream_t stream_;
    std::vector<int32_t> experts_;
    std::vector<int64_t> start_;  // by expert id: first grouped row (n_expert + 1 entries)
};

// A batch: x [n_tokens, n_embd] on the device; ids / weights [n_tokens, k] on the host (the
// grouping is planned on the host) and on the device (weights_dev, for the weighted sum) -> out
// [n_tokens, n_embd]. scratch: expert_ffn_scratch_bytes(w, n_tokens, k, int8).
void launch_expert_ffn_grouped(const ExpertWeights& w, const float* x, int64_t n_tokens,
                               const int32_t* ids_host, const float* weights_dev, int64_t k, bool int8,
                               void* scratch, float* out, cudaStream_t stream);

// One expert over n_rows contiguous activation rows x [n_rows, n_embd] -> y [n_rows, n_embd]: gate
// and up products (gate skipped for relu^2), w.act with the biases (null: none), down product and
// its bias, through launch_linear (the grouped path's arithmetic, GroupedExpertFfn::run_expert).
// Scratch: g, u, h [n_rows, n_ff] f32; xq, hq: q8 rows of n_embd and n_ff for the int8 path
// (q8_act_row_bytes each, n_rows of them).
struct ExpertBiases {
    const float* gate = nullptr;
    const float* up = nullptr;
    const float* down = nullptr;
};
void launch_expert_rows(const ExpertWeights& w, const void* gate, const void* up, const void* down,
                        const ExpertBiases& biases, const float* x, int64_t n_rows, bool int8, float* g,
                        float* u, float* h, void* xq, void* hq, float* y, cudaStream_t stream);

// out[i] = x[rows[i]], rows of n floats (rows: device int32 [n_rows]).
void launch_gather_rows(const float* x, const int32_t* rows, int64_t n_rows, int64_t n, float* out,
                        cudaStream_t stream);

// out[t] = sum over s = 0..k-1 in order of weights[t * k + s] * partial[order[t * k + s]] (rows of
// n_embd; order: device int32, null: the identity): the combine the fused and grouped FFNs end with.
void launch_expert_combine(const float* partial, const float* weights, const int32_t* order, int64_t n_tokens,
                           int64_t k, int64_t n_embd, float* out, cudaStream_t stream);

}  // namespace sharpi::cuda
