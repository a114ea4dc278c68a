// Causal multi-head attention with grouped KV heads over a KV cache stored as f32, f16, q8_0 or
// q4_0 rows (model/kv_cache.h).
//
// Token t of the batch sits at position pos0 + t and attends to cache positions [0, pos0 + t] (the
// last `window` of them in a sliding-window layer, those of its own chunk of `chunk` positions in a
// chunked layer; the cache already holds this batch's K and V).
// Query head h reads KV head h / (n_head / n_head_kv).
//
// Arithmetic (flash-decoding; the same for every batch size and thread count, so prefill and
// token-by-token decoding agree bit for bit): the rows of a (token, head) pair are cut into blocks
// of kAttentionBlock positions counted from position 0. Each block gives a partial softmax
//   s_j = dot_row_K(k_j, q) * scale, m = max_j s_j, p_j = exp(s_j - m), l = sum_j p_j (in order),
//   o = sum_j p_j * v_j (in order; v_j the V row decoded to f32, o[d] += p_j * v_j[d]),
// and the blocks are merged in position order into a running (M, L, O), starting from (-inf, 0, 0):
//   M' = max(M, m), a = exp(M - M'), b = exp(m - M'), L = L * a + l * b, O = O * a + o * b
// (O scaled by a, then b * o added), and the output is O * (1 / L). K rows are dotted with the
// quant row kernels of the stored type, V rows decoded by them (cpu/quant/kernels.h), all of the
// same ISA; the vector updates come from attention_kernels.h. Query values stay f32. A block of
// K/V rows is decoded to f32 once and read by every query row of a tile (the query heads of one KV
// head, for up to 32 rows of tokens x heads): dot_row(w, x) == dot_f32(dequant_row(w), x) bit for
// bit, so the tiling changes no result.
//
// Fast mode (AttentionShape::exact false, head_dim a multiple of 8; anything else runs the exact
// arithmetic above): the same blocks, merge and threading, but a block's partial is computed by
// register-blocked kernels (attention_kernels.h) over several query rows and keys at once (tiles of
// up to 64 rows): scores
// by 8-lane fma dots with a fixed reduction tree, p by a vectorised exp, l by an 8-lane sum, o by
// per-element fmas over the keys in order. Each (row, key) value is a fixed function of that row
// and key, so the tiling, batch and thread count change no bit here either; a row's keys outside
// its causal range get p = 0 exactly, which leaves l and o unchanged. Results differ from the exact
// arithmetic by f32 rounding (float64 oracle in tests/test_kv_cache.py).
//
// Threads: decoding has few (token, head) pairs, so when a batch has at most
// kAttentionSplitMaxTokens tokens and its context spans several blocks, every block is a work item
// over all heads, reading whole K then V rows in position order (a head's slice of consecutive
// positions is a cache row apart, which memory latency, not bandwidth, would bound), and the
// partials are merged afterwards (a buffer of at most kAttentionSplitMaxFloats; f16 rows, the
// default cache type, are read in place by f16 twins of the kernels, not decoded to a copy first:
// the conversion is exact, so the bits are the same); otherwise each
// tile is one item that merges its blocks as it goes, the tiles of the last tokens (the most
// blocks) first. Both run the merge above in the same order.
#pragma once

#include <cstdint>

#include "backend/op_types.h"
#include "cpu/quant/kernels.h"
#include "quant/ggml_type.h"
#include "threads/thread_pool.h"

namespace sharpi::cpu {

using sharpi::AttentionShape;
using sharpi::KvRows;

constexpr int64_t kAttentionBlock = 256;  // KV positions per partial softmax

// The split-mode partials buffer attention() allocates holds at most this many floats (a batch
// whose partials would not fit runs unsplit): a constant, so the budget planner charges the same
// bytes whatever the thread count. 4 MiB: 16 heads of 128 over 64K positions, 32 over 32K.
constexpr int64_t kAttentionSplitMaxFloats = int64_t{1} << 20;
// Batches of at most this many tokens (decoding) run split, when they span several blocks.
constexpr int64_t kAttentionSplitMaxTokens = 8;

// q: [n_tokens, n_head * head_dim] (row stride ldq); out: [n_tokens, n_head * head_dim] (row stride
// ldo). isa: the kernels' ISA (tests pick one; the engine uses active_isa()).
void attention(ThreadPool& pool, const float* q, int64_t ldq, const KvRows& k, const KvRows& v,
               int64_t n_tokens, int64_t pos0, const AttentionShape& shape, float* out, int64_t ldo,
               Isa isa = active_isa());

// Fast mode's partial softmax of one block, as attention() computes it (for tests of the kernels of
// one ISA): q [n_rows, head_dim], k and v [n_keys, head_dim] f32 rows (n_keys <= kAttentionBlock,
// head_dim a multiple of 8); row r reads keys [lo[r], hi[r]) (0 <= lo < hi <= n_keys). Writes the
// unnormalised partial: m[r], l[r] and o[r * head_dim + d] (header comment).
void attention_block_partial(Isa isa, const float* q, int64_t n_rows, const float* k, const float* v,
                             int64_t n_keys, int64_t head_dim, const int64_t* lo, const int64_t* hi,
                             float scale, float* m, float* l, float* o);

}  // namespace sharpi::cpu
