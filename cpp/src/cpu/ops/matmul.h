// Quantized matrix times f32 activations: the one op that touches weight bytes.
//
// W is [n_rows, n_cols] in ggml order (a row = n_cols contiguous elements of one output feature),
// stored as n_rows rows of `row_bytes` in `type`. X is [n_tokens, n_cols] f32, row stride ldx.
// Y[t, r] = sum_k W[r, k] * X[t, k] is written to y[t * ldy + r].
//
// Two modes (docs/design.md §8), chosen per call by `exact`:
// - exact: f32 activations. n_tokens == 1 (decode) uses dot_row per weight row; n_tokens > 1
//   (prefill) dequantizes each weight row once per block of tokens (sized to stay in L2) into
//   per-thread scratch and dots it with those tokens (register-tiled, bit-identical to dot_f32).
// - fast (exact == false), for weight types with integer kernels (cpu/quant/qdot.h): each token's
//   row of X is quantized once (q8_K / q8_0 / q8_1 as the weight type needs), then every output is
//   vec_dot(weight row, quantized token row); prefill runs vec_dot_tile over up to kMaxTileTokens
//   tokens at a time, which decodes each weight block once for all of them and gives each token
//   its vec_dot bits. Types without integer kernels (F32 / F16 / BF16) take the exact path, and
//   so does every type when the active ISA is scalar (no AVX2: the integer kernels there are the
//   portable reference, slower than the f32 path).
// Either way Y[t, r] is a fixed function of (weight row r, token row t): rows are split across the
// pool's threads with a fixed partition, and results never depend on n_tokens, the thread count,
// the tiling or timing (prefill == token-by-token decode, streamed == resident, bit for bit).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "backend/op_types.h"
#include "cpu/quant/kernels.h"
#include "cpu/quant/qdot.h"
#include "quant/ggml_type.h"
#include "threads/thread_pool.h"

namespace sharpi::cpu {

using sharpi::WeightView;

void matmul(ThreadPool& pool, const WeightView& w, const float* x, int64_t ldx, int64_t n_tokens, float* y,
            int64_t ldy, bool exact);

// The integer kernels fast mode dots `type` with, or nullptr where matmul takes the f32 path (exact
// mode, a type without integer kernels, or Isa::scalar).
const QuantDotKernels* fast_dot_kernels(GgmlType type, bool exact);

// Fast-mode prefill of weight rows [r0, r1) with n_tokens activation rows already quantized to
// act_format(w.type) (row t at xq + t * xq_bytes): y[t * ldy + r] = vec_dot(row r, token t), bit
// for bit, through vec_dot_tile on tiles of kMaxTileTokens tokens, blocked so a block of weight
// rows stays in L2 while the token tiles stream past it. Runs on the calling thread: the body of
// matmul's fast prefill, for callers that split the work over the pool themselves.
void quantized_rows(const WeightView& w, const QuantDotKernels& kernels, const uint8_t* xq, size_t xq_bytes,
                    int64_t n_tokens, int64_t r0, int64_t r1, float* y, int64_t ldy);

// One weight row . one activation row, bound to the row's mode and weight type by PreparedRow.
struct RowDot {
    DotRowFn f32_dot = nullptr;  // exact mode, or a weight type without integer kernels
    const float* x = nullptr;
    VecDotFn q_dot = nullptr;  // fast mode
    const void* xq = nullptr;
    int64_t n = 0;
    float operator()(const uint8_t* w_row) const {
        return q_dot ? q_dot(w_row, xq, n) : f32_dot(w_row, x, n);
    }
};

// One activation row x[n] prepared for row-by-row dot products (decode paths such as the experts
// of one token): the same value matmul would give for a single token, bit for bit. In fast mode
// bind() quantizes x, once per activation format, into a buffer this object owns; call bind() on
// the decode thread before the parallel loop that uses the RowDot, keep this object alive (and
// unmoved) while the RowDot is in use, and do not change x in between.
class PreparedRow {
  public:
    PreparedRow() = default;
    PreparedRow(const float* x, int64_t n, bool exact) { reset(x, n, exact); }
    PreparedRow(const PreparedRow&) = delete;
    PreparedRow& operator=(const PreparedRow&) = delete;

    void reset(const float* x, int64_t n, bool exact);
    // Throws UnsupportedError for a type with no CPU kernel, InvalidArgument when n is not a
    // multiple of its block size.
    RowDot bind(GgmlType type);

  private:
    const float* x_ = nullptr;
    int64_t n_ = 0;
    bool exact_ = true;
    std::vector<uint8_t> quantized_[4];  // by ActFormat
    bool ready_[4] = {false, false, false, false};
};

}  // namespace sharpi::cpu
