// DeepSeek-V4's attention over its per-position KV rows (model/archs/deepseek4.cpp builds the
// inputs; the arithmetic follows transformers' modeling_deepseek_v4.py).
//
// Per-sequence state lives in the layer's KV row of each position (HParams::dsv4_kv_row, f32):
//   [0, D)                          the sliding-window kv (normed, rotated)
//   ratio > 0:  [D, D + cD)         the compressor's kv row         (cD = coff * D; coff 2 on CSA)
//               [.., + cD)          its gate row + ape[p % ratio]
//               [.., + D)           the entry emitted by the window this position closes
//                                   (valid only where (p + 1) % ratio == 0)
//   ratio == 4: [.., + 2 Di)        the indexer compressor's kv row, then gate + ape [2 Di],
//               [.., + Di)          and its entry
// An entry depends only on rows at or before the position that closes its window, so a step
// computes exactly what a one-token decode of the same positions would: prefill, decode, chunked
// prefill, truncation and batching give the same bits.
//
// Each query attends to the last `window` positions (its own included) and, on a compressed layer,
// to the entries of the windows closed at or before it (w < (p + 1) / ratio): every one on HCA,
// the lightning indexer's top_k on CSA (higher score first, equal scores: lower entry first), with
// a per-head sink in the softmax; V is the same row as K, so the output's rope dims are rotated
// back by -p. The queries split over the pool; each computes the same bits whichever thread
// takes it.
#pragma once

#include <cstdint>

#include "backend/op_types.h"
#include "threads/thread_pool.h"

namespace sharpi::cpu {

// The layer's f32 KV rows: row p at data + p * stride (stride >= the layer's dsv4 row width).
struct F32Rows {
    float* data;
    int64_t stride;
};

// Stores the rows of positions pos0 .. pos0 + n_tokens - 1 (and the entries their windows close),
// then writes each token's attention output [n_head * head_dim] to out (row stride ldo).
void compressed_attention(ThreadPool& pool, const CompressedAttentionInputs& in, const F32Rows& rows,
                          int64_t n_tokens, int64_t pos0, const CompressedAttentionShape& shape, float* out,
                          int64_t ldo);

}  // namespace sharpi::cpu
