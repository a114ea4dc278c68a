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
// Token t of the batch sits at position pos0 + t and attends to cache positions [0, pos0 + t] (the
// cache already holds this batch's rows). Work is split over (token, head) pairs with the pool's
// fixed partition, one thread per pair start to finish, so results do not depend on the thread
// count or on the batch size (prefill == token-by-token decode, bit for bit).
#pragma once

#include <cstdint>

#include "cpu/threadpool.h"

namespace sharpi::cpu {

struct MlaShape {
    int64_t n_head = 0;
    int64_t n_lora_kv = 0;  // kv_lora_rank
    int64_t n_rot = 0;      // width of the RoPE part of the key
    float scale = 1.0f;     // 1 / sqrt(qk_nope + qk_rope), times the YaRN mscale^2 where used
};

// q_abs: [n_tokens, n_head * (n_lora_kv + n_rot)] (row stride ldq); latent: [n_ctx, n_lora_kv + n_rot]
// (row stride ld_latent); out: [n_tokens, n_head * n_lora_kv] (row stride ldo).
void mla_attention(ThreadPool& pool, const float* q_abs, int64_t ldq, const float* latent, int64_t ld_latent,
                   int64_t n_tokens, int64_t pos0, const MlaShape& shape, float* out, int64_t ldo);

}  // namespace sharpi::cpu
