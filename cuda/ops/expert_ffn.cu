// Kernels: expert_gate_up (a warp per (ff row, slot): gate and up rows of the slot's expert, their
// biases, then the activation), expert_matvec (a warp per (output row, slot) of the slot's expert), combine
// (the weighted sum over slots in slot order). A slot's expert rows start where PartRows says: expert ids[s]
// of the stacked tensor (resident) or the slot table's pointer (streamed); nothing else differs. All dots go
// through warp_row_dot, and the grouped path through the matvec / matmul launches that use the same per-row
// order, so prefill equals decode bit for bit.
#include <algorithm>
#include <cstring>
#include <string>

#include "ops/activation.cuh"
#include "ops/common.cuh"
#include "ops/elementwise.cuh"
#include "ops/expert_ffn.cuh"
#include "ops/matvec.cuh"
#include "ops/row_dot.cuh"

namespace sharpi::cuda {
namespace {

constexpr int kRowsPerBlock = 4;

// One part (gate, up or down) of the k selected experts: where slot s's first row is.
struct PartRows {
    const unsigned char* stacked;  // resident: the stacked tensor; null: read `slot`
    const int32_t* ids;            // resident: the device ids [k]
    size_t expert_bytes;           // resident: bytes of one expert in the stack
    const float* stacked_bias;     // resident: the stacked biases [n_expert, bias_len], null: none
    int64_t bias_len;
    const unsigned char* slot[kMaxSlotTable];
    const float* bias[kMaxSlotTable];  // slot tables: each slot's bias row, null: none
    uint32_t skip;  // slots computed elsewhere (the CPU): not read, their outputs left alone
    __device__ bool skipped(int64_t s) const { return ((skip >> s) & 1u) != 0; }
    // A product's row plus the slot's bias for it (the CPU adds the bias to the finished dot).
    __device__ float biased(int64_t s, int64_t row, float dot) const {
        const float* b =
            stacked != nullptr
                ? (stacked_bias != nullptr ? stacked_bias + static_cast<int64_t>(ids[s]) * bias_len : nullptr)
                : bias[s];
        return b != nullptr ? dot + b[row] : dot;
    }
    __device__ const unsigned char* expert(int64_t s) const {
        return stacked != nullptr ? stacked + static_cast<size_t>(ids[s]) * expert_bytes : slot[s];
    }
};

PartRows stacked_rows(const void* w, const int32_t* ids, size_t expert_bytes, const float* bias,
                      int64_t bias_len) {
    PartRows r{};
    r.stacked = static_cast<const unsigned char*>(w);
    r.ids = ids;
    r.expert_bytes = expert_bytes;
    r.stacked_bias = bias;
    r.bias_len = bias_len;
    return r;
}

PartRows table_rows(const void* const* pointers, const float* const* biases, int64_t k, uint32_t skip) {
    PartRows r{};
    for (int64_t s = 0; s < k; ++s) {
        r.slot[s] = static_cast<const unsigned char*>(pointers[s]);
        r.bias[s] = biases[s];
    }
    r.skip = skip;
    return r;
}

// x: one activation row shared by all slots (f32 or q8 as kInt8); h: [k, n_ff].
template <typename Block, bool kInt8>
__global__ void expert_gate_up_kernel(const PartRows gate, const PartRows up, ExpertActivation act,
                                      int64_t n_ff, int64_t n_embd, const void* __restrict__ x,
                                      float* __restrict__ h) {
    constexpr int kBlock = BmBlockSize<Block>::value;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
    const int64_t slot = blockIdx.y;
    if (row >= n_ff || gate.skipped(slot)) return;
    const int64_t at = row * (n_embd / kBlock);
    const float g = act.gated() ? warp_row_dot<Block, kInt8>(
                                      reinterpret_cast<const Block*>(gate.expert(slot)) + at, x, n_embd)
                                : 0.0f;
    const float u =
        warp_row_dot<Block, kInt8>(reinterpret_cast<const Block*>(up.expert(slot)) + at, x, n_embd);
    if (threadIdx.x % kWarp == 0)
        h[slot * n_ff + row] = expert_activation(act, gate.biased(slot, row, g), up.biased(slot, row, u));
}

// y[slot, row] = W_slot[row] . x_slot, x_slot at x + slot * x_row_bytes.
template <typename Block, bool kInt8>
__global__ void expert_matvec_kernel(const PartRows w, int64_t n_rows, int64_t n_cols,
                                     const void* __restrict__ x, size_t x_row_bytes, float* __restrict__ y) {
    constexpr int kBlock = BmBlockSize<Block>::value;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
    const int64_t slot = blockIdx.y;
    if (row >= n_rows || w.skipped(slot)) return;
    const Block* wr = reinterpret_cast<const Block*>(w.expert(slot)) + row * (n_cols / kBlock);
    const void* xs = static_cast<const unsigned char*>(x) + slot * x_row_bytes;
    const float sum = warp_row_dot<Block, kInt8>(wr, xs, n_cols);
    if (threadIdx.x % kWarp == 0) y[slot * n_rows + row] = w.biased(slot, row, sum);
}

// out[t, r] = sum over slots s in order of weights[t * k + s] * partial[pos(t * k + s), r], where
// pos is `order` (the grouped row of that slot) or the identity when order is null.
__global__ void combine_kernel(const float* __restrict__ partial, const float* __restrict__ weights,
                               const int32_t* __restrict__ order, int64_t k, int64_t n_embd,
                               float* __restrict__ out) {
    const int64_t t = blockIdx.y;
    const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (r >= n_embd) return;
    float acc = 0.0f;
    for (int64_t s = 0; s < k; ++s) {
        const int64_t slot = t * k + s;
        const int64_t row = order != nullptr ? order[slot] : slot;
        acc += weights[slot] * partial[row * n_embd + r];
    }
    out[t * n_embd + r] = acc;
}

// rows_out[i] = x[rows[i] / k]: the token row of each grouped (token, slot).
__global__ void gather_kernel(const float* __restrict__ x, const int32_t* __restrict__ rows, int64_t k,
                              int64_t n, int64_t n_rows, float* __restrict__ out) {
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= n_rows * n) return;
    const int64_t i = idx / n, c = idx % n;
    out[idx] = x[(rows[i] / k) * n + c];
}

size_t row_bytes(GgmlType type, int64_t n) {
    return ggml_row_size(type, n);
}

// Bump allocator over the caller's scratch; every piece 256-byte aligned.
class Scratch {
  public:
    explicit Scratch(void* base) : base_(static_cast<unsigned char*>(base)) {}
    template <typename T>
    T* take(size_t bytes) {
        T* p = reinterpret_cast<T*>(base_ == nullptr ? nullptr : base_ + used_);
        used_ += (bytes + 255) / 256 * 256;
        return p;
    }
    size_t used() const { return used_; }

  private:
    unsigned char* base_;
    size_t used_ = 0;
};

struct Pieces {
    float *h, *partial, *xg, *g, *u;
    void *xq, *hq;
    int32_t *rows, *order;
};

// The one layout both expert_ffn_scratch_bytes and the launches use (base null: sizes only).
Pieces carve(const ExpertWeights& w, int64_t n_tokens, int64_t k, bool int8, void* base, size_t* total) {
    Scratch s(base);
    const int64_t n_rows = n_tokens * k;
    Pieces p{};
    p.h = s.take<float>(sizeof(float) * n_rows * w.n_ff);
    p.partial = s.take<float>(sizeof(float) * n_rows * w.n_embd);
    p.xg = s.take<float>(sizeof(float) * n_rows * w.n_embd);
    p.g = s.take<float>(sizeof(float) * n_rows * w.n_ff);
    p.u = s.take<float>(sizeof(float) * n_rows * w.n_ff);
    const size_t xq_row =
        int8 ? std::max(q8_act_row_bytes(w.gate_type, w.n_embd), q8_act_row_bytes(w.up_type, w.n_embd)) : 0;
    p.xq = s.take<unsigned char>(xq_row * n_rows);
    p.hq = s.take<unsigned char>((int8 ? q8_act_row_bytes(w.down_type, w.n_ff) : 0) * n_rows);
    p.rows = s.take<int32_t>(sizeof(int32_t) * n_rows);
    p.order = s.take<int32_t>(sizeof(int32_t) * n_rows);
    if (total != nullptr) *total = s.used();
    return p;
}

bool uses_int8(GgmlType type, bool int8) {
    return int8 && q8_act_row_bytes(type, 256) > 0;
}

}  // namespace

size_t expert_ffn_scratch_bytes(const ExpertWeights& w, int64_t n_tokens, int64_t k, bool int8) {
    size_t total = 0;
    carve(w, n_tokens, k, int8, nullptr, &total);
    return total;
}

namespace {

// The decode launches for any PartRows: the one body of the resident and the slot-table entries.
// cpu_rows: the host rows of the slots the PartRows skip (see ExpertSlotTable), or null.
void decode(const ExpertWeights& w, const PartRows& gate_rows, const PartRows& up_rows,
            const PartRows& down_rows, const float* cpu_rows, const float* x, const float* weights, int64_t k,
            bool int8, void* scratch, float* out, cudaStream_t stream) {
    const Pieces p = carve(w, 1, k, int8, scratch, nullptr);
    const dim3 ff_grid(div_up(w.n_ff, kRowsPerBlock), static_cast<unsigned int>(k));
    const dim3 embd_grid(div_up(w.n_embd, kRowsPerBlock), static_cast<unsigned int>(k));
    if (w.gate_type == w.up_type) {
        const bool q8 = uses_int8(w.gate_type, int8);
        if (q8) launch_quantize_act(w.gate_type, x, w.n_embd, 1, p.xq, stream);
        dispatch_type(w.gate_type, "expert gate/up", [&](auto tag) {
            using Block = BlockOf<decltype(tag)>;
            if constexpr (bm_has_int8<Block>()) {
                if (q8) {
                    expert_gate_up_kernel<Block, true><<<ff_grid, kRowsPerBlock * kWarp, 0, stream>>>(
                        gate_rows, up_rows, w.act, w.n_ff, w.n_embd, p.xq, p.h);
                    return;
                }
            }
            expert_gate_up_kernel<Block, false><<<ff_grid, kRowsPerBlock * kWarp, 0, stream>>>(
                gate_rows, up_rows, w.act, w.n_ff, w.n_embd, x, p.h);
        });
        SHARPI_CUDA_CHECK_LAUNCH("expert gate/up");
    } else {
        // Mixed gate / up types (rare): the two projections separately (their biases added), then the
        // activation.
        for (int which = w.act.gated() ? 0 : 1; which < 2; ++which) {
            const GgmlType type = which == 0 ? w.gate_type : w.up_type;
            const PartRows& rows = which == 0 ? gate_rows : up_rows;
            const bool q8 = uses_int8(type, int8);
            if (q8) launch_quantize_act(type, x, w.n_embd, 1, p.xq, stream);
            dispatch_type(type, "expert gate/up", [&](auto tag) {
                using Block = BlockOf<decltype(tag)>;
                float* y = which == 0 ? p.g : p.u;
                if constexpr (bm_has_int8<Block>()) {
                    if (q8) {
                        expert_matvec_kernel<Block, true><<<ff_grid, kRowsPerBlock * kWarp, 0, stream>>>(
                            rows, w.n_ff, w.n_embd, p.xq, 0, y);
                        return;
                    }
                }
                expert_matvec_kernel<Block, false>
                    <<<ff_grid, kRowsPerBlock * kWarp, 0, stream>>>(rows, w.n_ff, w.n_embd, x, 0, y);
            });
            SHARPI_CUDA_CHECK_LAUNCH("expert gate/up");
        }
        launch_expert_activation(w.act, p.g, p.u, nullptr, nullptr, k, w.n_ff, p.h, stream);
    }
    const bool q8_down = uses_int8(w.down_type, int8);
    if (q8_down) launch_quantize_act(w.down_type, p.h, w.n_ff, k, p.hq, stream);
    dispatch_type(w.down_type, "expert down", [&](auto tag) {
        using Block = BlockOf<decltype(tag)>;
        if constexpr (bm_has_int8<Block>()) {
            if (q8_down) {
                expert_matvec_kernel<Block, true><<<embd_grid, kRowsPerBlock * kWarp, 0, stream>>>(
                    down_rows, w.n_embd, w.n_ff, p.hq, q8_act_row_bytes(w.down_type, w.n_ff), p.partial);
                return;
            }
        }
        expert_matvec_kernel<Block, false><<<embd_grid, kRowsPerBlock * kWarp, 0, stream>>>(
            down_rows, w.n_embd, w.n_ff, p.h, sizeof(float) * w.n_ff, p.partial);
    });
    SHARPI_CUDA_CHECK_LAUNCH("expert down");
    for (int64_t s = 0; s < k && cpu_rows != nullptr; ++s) {
        if (((down_rows.skip >> s) & 1u) == 0) continue;
        cuda_check(cudaMemcpyAsync(p.partial + s * w.n_embd, cpu_rows + s * w.n_embd,
                                   sizeof(float) * w.n_embd, cudaMemcpyHostToDevice, stream),
                   "expert ffn: a CPU-computed expert's row");
    }
    combine_kernel<<<dim3(div_up(w.n_embd, 256), 1), 256, 0, stream>>>(p.partial, weights, nullptr, k,
                                                                       w.n_embd, out);
    SHARPI_CUDA_CHECK_LAUNCH("expert combine");
}

}  // namespace

void launch_expert_ffn_decode(const ExpertWeights& w, const float* x, const int32_t* ids,
                              const float* weights, int64_t k, bool int8, void* scratch, float* out,
                              cudaStream_t stream) {
    decode(w, stacked_rows(w.gate, ids, row_bytes(w.gate_type, w.n_embd) * w.n_ff, w.gate_b, w.n_ff),
           stacked_rows(w.up, ids, row_bytes(w.up_type, w.n_embd) * w.n_ff, w.up_b, w.n_ff),
           stacked_rows(w.down, ids, row_bytes(w.down_type, w.n_ff) * w.n_embd, w.down_b, w.n_embd), nullptr,
           x, weights, k, int8, scratch, out, stream);
}

void launch_expert_ffn_decode_slots(const ExpertWeights& w, const ExpertSlotTable& slots, const float* x,
                                    const float* weights, int64_t k, bool int8, void* scratch, float* out,
                                    cudaStream_t stream) {
    if (k < 1 || k > kMaxSlotTable) {
        throw InvalidArgument("[cuda] expert slot table: " + std::to_string(k) + " experts per token (1.." +
                              std::to_string(kMaxSlotTable) + ")");
    }
    const uint32_t skip = slots.cpu_rows != nullptr ? slots.cpu_mask : 0u;
    decode(w, table_rows(slots.gate, slots.gate_b, k, skip), table_rows(slots.up, slots.up_b, k, skip),
           table_rows(slots.down, slots.down_b, k, skip), slots.cpu_rows, x, weights, k, int8, scratch, out,
           stream);
}

GroupedExpertFfn::GroupedExpertFfn(const ExpertWeights& w, const float* x, int64_t n_tokens,
                                   const int32_t* ids_host, int64_t k, bool int8, void* scratch,
                                   cudaStream_t stream)
    : w_(w), n_tokens_(n_tokens), k_(k), int8_(int8), scratch_(scratch), stream_(stream) {
    if (n_tokens <= 0) return;
    const Pieces p = carve(w, n_tokens, k, int8, scratch, nullptr);
    const int64_t n_rows = n_tokens * k;
    // Group the (token, slot) rows by expert, tokens in order within an expert.
    int32_t n_expert = 0;
    for (int64_t i = 0; i < n_rows; ++i) n_expert = std::max(n_expert, ids_host[i] + 1);
    std::vector<int32_t> rows(static_cast<size_t>(n_rows)), order(static_cast<size_t>(n_rows));
    start_.assign(static_cast<size_t>(n_expert) + 1, 0);
    for (int64_t i = 0; i < n_rows; ++i) ++start_[static_cast<size_t>(ids_host[i]) + 1];
    for (int32_t e = 0; e < n_expert; ++e) {
        if (start_[e + 1] > 0) experts_.push_back(e);
        start_[e + 1] += start_[e];
    }
    std::vector<int64_t> fill(start_.begin(), start_.end() - 1);
    for (int64_t i = 0; i < n_rows; ++i) {
        const int64_t at = fill[static_cast<size_t>(ids_host[i])]++;
        rows[static_cast<size_t>(at)] = static_cast<int32_t>(i);
        order[static_cast<size_t>(i)] = static_cast<int32_t>(at);
    }
    // Pageable sources: cudaMemcpyAsync returns once they are staged, so the vectors may go.
    cuda_check(cudaMemcpyAsync(p.rows, rows.data(), sizeof(int32_t) * n_rows, cudaMemcpyHostToDevice, stream),
               "expert ffn: grouped rows");
    cuda_check(
        cudaMemcpyAsync(p.order, order.data(), sizeof(int32_t) * n_rows, cudaMemcpyHostToDevice, stream),
        "expert ffn: slot order");
    gather_kernel<<<div_up(n_rows * w.n_embd, 256), 256, 0, stream>>>(x, p.rows, k, w.n_embd, n_rows, p.xg);
    SHARPI_CUDA_CHECK_LAUNCH("expert gather");
}

void launch_expert_rows(const ExpertWeights& w, const void* gate, const void* up, const void* down,
                        const ExpertBiases& biases, const float* x, int64_t n_rows, bool int8, float* g,
                        float* u, float* h, void* xq, void* hq, float* y, cudaStream_t stream) {
    if (w.act.gated()) launch_linear(w.gate_type, gate, w.n_ff, w.n_embd, x, n_rows, int8, xq, g, stream);
    launch_linear(w.up_type, up, w.n_ff, w.n_embd, x, n_rows, int8, xq, u, stream);
    launch_expert_activation(w.act, g, u, biases.gate, biases.up, n_rows, w.n_ff, h, stream);
    launch_linear(w.down_type, down, w.n_embd, w.n_ff, h, n_rows, int8, hq, y, stream);
    if (biases.down != nullptr) launch_add_bias(y, biases.down, n_rows, w.n_embd, stream);
}

void GroupedExpertFfn::run_expert(int32_t e, const void* gate, const void* up, const void* down) {
    const Pieces p = carve(w_, n_tokens_, k_, int8_, scratch_, nullptr);
    const int64_t o = start_[static_cast<size_t>(e)], c = start_[static_cast<size_t>(e) + 1] - o;
    ExpertBiases biases;
    if (w_.gate_b != nullptr) biases.gate = w_.gate_b + static_cast<int64_t>(e) * w_.n_ff;
    if (w_.up_b != nullptr) biases.up = w_.up_b + static_cast<int64_t>(e) * w_.n_ff;
    if (w_.down_b != nullptr) biases.down = w_.down_b + static_cast<int64_t>(e) * w_.n_embd;
    launch_expert_rows(w_, gate, up, down, biases, p.xg + o * w_.n_embd, c, int8_, p.g + o * w_.n_ff,
                       p.u + o * w_.n_ff, p.h + o * w_.n_ff, p.xq, p.hq, p.partial + o * w_.n_embd, stream_);
}

void GroupedExpertFfn::combine(const float* weights_dev, float* out) {
    if (n_tokens_ <= 0) return;
    const Pieces p = carve(w_, n_tokens_, k_, int8_, scratch_, nullptr);
    combine_kernel<<<dim3(div_up(w_.n_embd, 256), static_cast<unsigned int>(n_tokens_)), 256, 0, stream_>>>(
        p.partial, weights_dev, p.order, k_, w_.n_embd, out);
    SHARPI_CUDA_CHECK_LAUNCH("expert combine");
}

void launch_expert_ffn_grouped(const ExpertWeights& w, const float* x, int64_t n_tokens,
                               const int32_t* ids_host, const float* weights_dev, int64_t k, bool int8,
                               void* scratch, float* out, cudaStream_t stream) {
    if (n_tokens <= 0) return;
    GroupedExpertFfn grouped(w, x, n_tokens, ids_host, k, int8, scratch, stream);
    const size_t gate_bytes = row_bytes(w.gate_type, w.n_embd) * w.n_ff;
    const size_t up_bytes = row_bytes(w.up_type, w.n_embd) * w.n_ff;
    const size_t down_bytes = row_bytes(w.down_type, w.n_ff) * w.n_embd;
    for (const int32_t e : grouped.experts()) {
        grouped.run_expert(e, static_cast<const unsigned char*>(w.gate) + e * gate_bytes,
                           static_cast<const unsigned char*>(w.up) + e * up_bytes,
                           static_cast<const unsigned char*>(w.down) + e * down_bytes);
    }
    grouped.combine(weights_dev, out);
}

void launch_gather_rows(const float* x, const int32_t* rows, int64_t n_rows, int64_t n, float* out,
                        cudaStream_t stream) {
    if (n_rows <= 0) return;
    gather_kernel<<<div_up(n_rows * n, 256), 256, 0, stream>>>(x, rows, 1, n, n_rows, out);
    SHARPI_CUDA_CHECK_LAUNCH("gather rows");
}

void launch_expert_combine(const float* partial, const float* weights, const int32_t* order, int64_t n_tokens,
                           int64_t k, int64_t n_embd, float* out, cudaStream_t stream) {
    if (n_tokens <= 0) return;
    combine_kernel<<<dim3(div_up(n_embd, 256), static_cast<unsigned int>(n_tokens)), 256, 0, stream>>>(
        partial, weights, order, k, n_embd, out);
    SHARPI_CUDA_CHECK_LAUNCH("expert combine");
}

}  // namespace sharpi::cuda
