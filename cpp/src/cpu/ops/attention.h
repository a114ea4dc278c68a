// Causal multi-head attention with grouped KV heads over an f32 KV cache.
//
// Token t of the batch sits at position pos0 + t and attends to cache positions [0, pos0 + t]
// (the cache already holds this batch's K and V). Query head h reads KV head h / (n_head / n_head_kv).
// Work is split over (token, head) pairs with the pool's fixed partition; each pair is computed by
// one thread start to finish, so results do not depend on the thread count.
#pragma once

#include <cstdint>

#include "cpu/threadpool.h"

namespace sharpi::cpu {

struct AttentionShape {
    int64_t n_head = 0;
    int64_t n_head_kv = 0;
    int64_t head_dim = 0;
    float scale = 1.0f;  // usually 1 / sqrt(head_dim)
};

// q: [n_tokens, n_head * head_dim] (row stride ldq); k_cache, v_cache: [n_ctx, n_head_kv * head_dim]
// (row stride ld_kv); out: [n_tokens, n_head * head_dim] (row stride ldo).
void attention(ThreadPool& pool, const float* q, int64_t ldq, const float* k_cache, const float* v_cache,
               int64_t ld_kv, int64_t n_tokens, int64_t pos0, const AttentionShape& shape, float* out,
               int64_t ldo);

}  // namespace sharpi::cpu
