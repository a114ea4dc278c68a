// Kernels: expert_gate_up (a warp per (ff row, slot): gate and up rows of the slot's expert, then
// silu·mul), expert_matvec (a warp per (output row, slot) of the slot's expert), combine (the
// weighted sum over slots in slot order). Expert e's rows start e * rows * row_blocks blocks into
// the stacked tensor. All dots go through warp_row_dot, and the grouped path through the matvec /
// matmul launches that use the same per-row order, so prefill equals decode bit for bit.
#include <algorithm>
#include <cstring>
#include <string>

#include "ops/activation.cuh"
#include "ops/common.cuh"
#include "ops/expert_ffn.cuh"
#include "ops/matvec.cuh"
#include "ops/row_dot.cuh"

namespace sharpi::cuda {
namespace {

constexpr int kRowsPerBlock = 4;

// x: one activation row shared by all slots (f32 or q8 as kInt8); h: [k, n_ff].
template <typename Block, bool kInt8>
__global__ void expert_gate_up_kernel(const Block* __restrict__ gate, const Block* __restrict__ up,
                                      int64_t n_ff, int64_t n_embd, const int32_t* __restrict__ ids,
                                      const void* __restrict__ x, float* __restrict__ h) {
    constexpr int kBlock = BmBlockSize<Block>::value;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
    const int64_t slot = blockIdx.y;
    if (row >= n_ff) return;
    const int64_t row_blocks = n_embd / kBlock;
    const int64_t base = (static_cast<int64_t>(ids[slot]) * n_ff + row) * row_blocks;
    const float g = warp_row_dot<Block, kInt8>(gate + base, x, n_embd);
    const float u = warp_row_dot<Block, kInt8>(up + base, x, n_embd);
    if (threadIdx.x % kWarp == 0) h[slot * n_ff + row] = silu_mul(g, u);
}

// y[slot, row] = W_{ids[slot]}[row] . x_slot, x_slot at x + slot * x_row_bytes.
template <typename Block, bool kInt8>
__global__ void expert_matvec_kernel(const Block* __restrict__ w, int64_t n_rows, int64_t n_cols,
                                     const int32_t* __restrict__ ids, const void* __restrict__ x,
                                     size_t x_row_bytes, float* __restrict__ y) {
    constexpr int kBlock = BmBlockSize<Block>::value;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
    const int64_t slot = blockIdx.y;
    if (row >= n_rows) return;
    const int64_t base = (static_cast<int64_t>(ids[slot]) * n_rows + row) * (n_cols / kBlock);
    const void* xs = static_cast<const unsigned char*>(x) + slot * x_row_bytes;
    const float sum = warp_row_dot<Block, kInt8>(w + base, xs, n_cols);
    if (threadIdx.x % kWarp == 0) y[slot * n_rows + row] = sum;
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

void launch_expert_ffn_decode(const ExpertWeights& w, const float* x, const int32_t* ids,
                              const float* weights, int64_t k, bool int8, void* scratch, float* out,
                              cudaStream_t stream) {
    const Pieces p = carve(w, 1, k, int8, scratch, nullptr);
    const dim3 ff_grid(div_up(w.n_ff, kRowsPerBlock), static_cast<unsigned int>(k));
    const dim3 embd_grid(div_up(w.n_embd, kRowsPerBlock), static_cast<unsigned int>(k));
    if (w.gate_type == w.up_type) {
        const bool q8 = uses_int8(w.gate_type, int8);
        if (q8) launch_quantize_act(w.gate_type, x, w.n_embd, 1, p.xq, stream);
        dispatch_type(w.gate_type, "expert gate/up", [&](auto tag) {
            using Block = BlockOf<decltype(tag)>;
            const Block* gate = static_cast<const Block*>(w.gate);
            const Block* up = static_cast<const Block*>(w.up);
            if constexpr (bm_has_int8<Block>()) {
                if (q8) {
                    expert_gate_up_kernel<Block, true><<<ff_grid, kRowsPerBlock * kWarp, 0, stream>>>(
                        gate, up, w.n_ff, w.n_embd, ids, p.xq, p.h);
                    return;
                }
            }
            expert_gate_up_kernel<Block, false>
                <<<ff_grid, kRowsPerBlock * kWarp, 0, stream>>>(gate, up, w.n_ff, w.n_embd, ids, x, p.h);
        });
        SHARPI_CUDA_CHECK_LAUNCH("expert gate/up");
    } else {
        // Mixed gate / up types (rare): the two projections separately, then silu·mul.
        for (int which = 0; which < 2; ++which) {
            const GgmlType type = which == 0 ? w.gate_type : w.up_type;
            const bool q8 = uses_int8(type, int8);
            if (q8) launch_quantize_act(type, x, w.n_embd, 1, p.xq, stream);
            dispatch_type(type, "expert gate/up", [&](auto tag) {
                using Block = BlockOf<decltype(tag)>;
                const Block* mat = static_cast<const Block*>(which == 0 ? w.gate : w.up);
                float* y = which == 0 ? p.g : p.u;
                if constexpr (bm_has_int8<Block>()) {
                    if (q8) {
                        expert_matvec_kernel<Block, true><<<ff_grid, kRowsPerBlock * kWarp, 0, stream>>>(
                            mat, w.n_ff, w.n_embd, ids, p.xq, 0, y);
                        return;
                    }
                }
                expert_matvec_kernel<Block, false>
                    <<<ff_grid, kRowsPerBlock * kWarp, 0, stream>>>(mat, w.n_ff, w.n_embd, ids, x, 0, y);
            });
            SHARPI_CUDA_CHECK_LAUNCH("expert gate/up");
        }
        launch_silu_mul(p.g, p.u, k * w.n_ff, p.h, stream);
    }
    const bool q8_down = uses_int8(w.down_type, int8);
    if (q8_down) launch_quantize_act(w.down_type, p.h, w.n_ff, k, p.hq, stream);
    dispatch_type(w.down_type, "expert down", [&](auto tag) {
        using Block = BlockOf<decltype(tag)>;
        const Block* down = static_cast<const Block*>(w.down);
        if constexpr (bm_has_int8<Block>()) {
            if (q8_down) {
                expert_matvec_kernel<Block, true><<<embd_grid, kRowsPerBlock * kWarp, 0, stream>>>(
                    down, w.n_embd, w.n_ff, ids, p.hq, q8_act_row_bytes(w.down_type, w.n_ff), p.partial);
                return;
            }
        }
        expert_matvec_kernel<Block, false><<<embd_grid, kRowsPerBlock * kWarp, 0, stream>>>(
            down, w.n_embd, w.n_ff, ids, p.h, sizeof(float) * w.n_ff, p.partial);
    });
    SHARPI_CUDA_CHECK_LAUNCH("expert down");
    combine_kernel<<<dim3(div_up(w.n_embd, 256), 1), 256, 0, stream>>>(p.partial, weights, nullptr, k,
                                                                       w.n_embd, out);
    SHARPI_CUDA_CHECK_LAUNCH("expert combine");
}

void launch_expert_ffn_grouped(const ExpertWeights& w, const float* x, int64_t n_tokens,
                               const int32_t* ids_host, const float* weights_dev, int64_t k, bool int8,
                               void* scratch, float* out, cudaStream_t stream) {
    if (n_tokens <= 0) return;
    const Pieces p = carve(w, n_tokens, k, int8, scratch, nullptr);
    const int64_t n_rows = n_tokens * k;
    // Group the (token, slot) rows by expert, tokens in order within an expert.
    int32_t n_expert = 0;
    for (int64_t i = 0; i < n_rows; ++i) n_expert = std::max(n_expert, ids_host[i] + 1);
    std::vector<int32_t> rows, order(static_cast<size_t>(n_rows));
    std::vector<int64_t> start(static_cast<size_t>(n_expert) + 1, 0);
    for (int64_t i = 0; i < n_rows; ++i) ++start[static_cast<size_t>(ids_host[i]) + 1];
    for (int32_t e = 0; e < n_expert; ++e) start[e + 1] += start[e];
    rows.resize(static_cast<size_t>(n_rows));
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
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
    const size_t gate_bytes = row_bytes(w.gate_type, w.n_embd) * w.n_ff;
    const size_t up_bytes = row_bytes(w.up_type, w.n_embd) * w.n_ff;
    const size_t down_bytes = row_bytes(w.down_type, w.n_ff) * w.n_embd;
    for (int32_t e = 0; e < n_expert; ++e) {
        const int64_t o = start[e], c = start[e + 1] - start[e];
        if (c == 0) continue;
        const float* xe = p.xg + o * w.n_embd;
        launch_linear(w.gate_type, static_cast<const unsigned char*>(w.gate) + e * gate_bytes, w.n_ff,
                      w.n_embd, xe, c, int8, p.xq, p.g + o * w.n_ff, stream);
        launch_linear(w.up_type, static_cast<const unsigned char*>(w.up) + e * up_bytes, w.n_ff, w.n_embd, xe,
                      c, int8, p.xq, p.u + o * w.n_ff, stream);
        launch_silu_mul(p.g + o * w.n_ff, p.u + o * w.n_ff, c * w.n_ff, p.h + o * w.n_ff, stream);
        launch_linear(w.down_type, static_cast<const unsigned char*>(w.down) + e * down_bytes, w.n_embd,
                      w.n_ff, p.h + o * w.n_ff, c, int8, p.hq, p.partial + o * w.n_embd, stream);
    }
    combine_kernel<<<dim3(div_up(w.n_embd, 256), static_cast<unsigned int>(n_tokens)), 256, 0, stream>>>(
        p.partial, weights_dev, p.order, k, w.n_embd, out);
    SHARPI_CUDA_CHECK_LAUNCH("expert combine");
}

}  // namespace sharpi::cuda
