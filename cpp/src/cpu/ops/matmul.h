// Quantized matrix times f32 activations: the one op that touches weight bytes.
//
// W is [n_rows, n_cols] in ggml order (a row = n_cols contiguous elements of one output feature),
// stored as n_rows rows of `row_bytes` in `type`. X is [n_tokens, n_cols] f32, row stride ldx.
// Y[t, r] = sum_k W[r, k] * X[t, k] is written to y[t * ldy + r].
//
// n_tokens == 1 (decode) uses dot_row per weight row; n_tokens > 1 (prefill) dequantizes each
// weight row once per block of tokens (sized to stay in L2) into per-thread scratch and dots it with
// those tokens (register-tiled, bit-identical to dot_f32). Rows are split across the
// pool's threads with a fixed partition, so results do not depend on timing or thread count.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpu/threadpool.h"
#include "quant/ggml_type.h"

namespace sharpi::cpu {

struct WeightView {
    GgmlType type = GgmlType::F32;
    const uint8_t* data = nullptr;
    int64_t n_rows = 0;
    int64_t n_cols = 0;
    size_t row_bytes = 0;
};

void matmul(ThreadPool& pool, const WeightView& w, const float* x, int64_t ldx, int64_t n_tokens, float* y,
            int64_t ldy);

}  // namespace sharpi::cpu
