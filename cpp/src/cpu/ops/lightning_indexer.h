// The lightning indexer of DeepSeek Sparse Attention (DeepSeek-V3.2, llama.cpp's deepseek32): which
// cached positions each query's MLA attention reads.
//
// Each KV row of the layer holds, after the MLA latent and RoPE key (key_offset elements), the
// indexer's key k_j of position j (head_dim elements, stored in the cache's type like the rest of
// the row; model/kv_cache.h). Token t at position p = pos0 + t scores every position j <= p:
//   score_j = sum_h (w[t,h] * weight_scale) * max(0, dot_f32(q[t,h], k_j))      (h in order, f32)
// and keeps the top_k positions by score. Ties (equal f32 scores) go to the earlier position: neither
// reference defines an order (llama.cpp's CPU top_k is std::partial_sort, torch.topk's order is
// unspecified), so sharpi fixes one. When p + 1 <= top_k every position is kept and nothing is
// scored (what both references select too: their masked scores are -inf). The kept positions are
// written in ascending order, the order the attention accumulates in.
//
// The scores are those of transformers' DeepseekV32Indexer and llama.cpp's graph, which computes
// relu(q.k) * w / sqrt(n_head * head_dim); llama.cpp's Hadamard rotation of q and k (applied only to
// quantized caches) is orthogonal and leaves q.k unchanged up to rounding, so it is not applied here.
// No fp8 step: neither transformers nor llama.cpp's GGUF path simulates the reference's fp8 scoring.
//
// Work is split over tokens with the pool's fixed partition; a token's selection depends only on its
// own row and the cache, never on the batch or the thread count.
#pragma once

#include <cstdint>

#include "backend/op_types.h"
#include "cpu/ops/attention.h"
#include "threads/thread_pool.h"

namespace sharpi::cpu {

using sharpi::IndexerShape;

// q: [n_tokens, n_head * head_dim] (RoPE applied; row stride ldq); w: [n_tokens, n_head] (ldw);
// rows: >= pos0 + n_tokens KV rows of the layer. positions: [n_tokens, top_k], count: [n_tokens].
void lightning_indexer(ThreadPool& pool, const float* q, int64_t ldq, const float* w, int64_t ldw,
                       const KvRows& rows, int64_t n_tokens, int64_t pos0, const IndexerShape& shape,
                       int32_t* positions, int32_t* count, Isa isa = active_isa());

}  // namespace sharpi::cpu
