// Multi-head latent attention (DeepSeek-V2/V3) in the absorbed-matrix form, over a cache of the
// compressed latent.
//
// Each cache row holds one position's latent: c (kv_lora_rank values, RMS-normalised) followed by
// the shared RoPE key k_pe (n_rot values). The caller has folded each head's key up-projection into
// its query (q_abs_h = [W_kb_h^T q_nope_h, q_pe_h], width kv_lora_rank + n_rot), so
//   score_j = q_abs_h . row_j * scale,  out_h = sum_j softmax(score)_j * c_j   (kv_lora_rank wide)
// and the caller applies each head's value up-projection W_vb_h to out_h afterwards. Every head
// reads the same single latent "KV head": the cache holds kv_lora_rank + n_rot floats per position,
// not n_head expanded keys and values.
//
// The cache rows are stored as f32, f16, q8_0 or q4_0 (model/kv_cache.h; one type for the whole
// row, which is why a block type needs kv_lora_rank + n_rot to be a multiple of 32). Arithmetic per
// (token, head), the same for every stored type: each row is decoded to f32 by its type's row
// kernel (cpu/quant/kernels.h; an f32 row is read in place), score_j = dot_f32(q_abs_h, row_j) *
// scale, p_j = exp(score_j - max), total = sum p_j in double, out_h[d] = sum_j (p_j * (1 / total)) *
// c_j[d] accumulated in position order. Rows are decoded in blocks shared by a few heads of a token.
//
// Token t of the batch sits at position pos0 + t and attends to cache positions [0, pos0 + t] (the
// cache already holds this batch's rows), or, given a selection (DeepSeek Sparse Attention), to its
// selected positions only, read in ascending order; selecting all of [0, pos0 + t] gives the dense
// result bit for bit, since each row's arithmetic and the accumulation order are the same. Work is split over
// (token, group of heads) items with the pool's fixed partition, one thread per item start to finish; a
// head's arithmetic does not depend on its group, the thread count or the batch size (prefill ==
// token-by-token decode, bit for bit).
#pragma once

#include <cstdint>

#include "backend/op_types.h"
#include "cpu/ops/attention.h"
#include "threads/thread_pool.h"

namespace sharpi::cpu {

using sharpi::MlaSelection;
using sharpi::MlaShape;

// q_abs: [n_tokens, n_head * (n_lora_kv + n_rot)] (row stride ldq); latent: [>= pos0 + n_tokens]
// rows of n_lora_kv + n_rot elements of latent.type; out: [n_tokens, n_head * n_lora_kv] (row
// stride ldo). isa: the kernels' ISA (tests pick one; the engine uses active_isa()). selection:
// nullptr for dense causal attention (backend/op_types.h MlaSelection).
void mla_attention(ThreadPool& pool, const float* q_abs, int64_t ldq, const KvRows& latent, int64_t n_tokens,
                   int64_t pos0, const MlaShape& shape, float* out, int64_t ldo, Isa isa = active_isa(),
                   const MlaSelection* selection = nullptr);

}  // namespace sharpi::cpu
