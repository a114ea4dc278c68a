// The RAM budget planner (docs/design.md §2): what a streaming session holds besides its expert slots, and
// from it the smallest budget that runs and the number of slots a budget buys. Pure arithmetic on a
// loaded (or only mapped) model: the engine plans before it allocates the KV cache or the expert
// cache, and `sharpi inspect` / Session-less callers (sharpi._core.memory_plan) get the same numbers.
//
// Charged, in bytes: the dense weights (read into RAM when streaming); the KV cache at its stored
// types (model/kv_cache.h); buffers = the scratch arena's high-water mark for one batch of
// max_batch tokens, the batch's logits, attention's split-mode partials (cpu/ops/attention.h) and a
// fixed 8 MiB for the rest (thread stacks beyond the main one, reader queues and their aligned
// bounce buffers, timeline spans); then top-k expert slots plus the predictor's staging slots.
#pragma once

#include <cstdint>
#include <string>

#include "model/model.h"
#include "quant/ggml_type.h"

namespace sharpi {

struct MemoryPlanRequest {
    int64_t n_ctx = 0;
    int64_t n_seq = 1;             // sequences held at once: each has its own KV cache and recurrent state
    int64_t max_draft_tokens = 0;  // recurrent state copies per sequence for speculative rewinds
    bool mtp = false;              // the MTP head runs (SessionOptions::mtp): its weights and state
    std::string mtp_file;          // SessionOptions::mtp_file
    GgmlType type_k = GgmlType::F32;
    GgmlType type_v = GgmlType::F32;
    int64_t max_batch = 256;
    uint64_t n_staging = 0;  // predictor staging slots (lookahead * top_k), 0 without a predictor
};

struct MemoryPlan {
    uint64_t dense_bytes = 0;
    uint64_t kv_bytes = 0;  // all n_seq sequences
    int64_t n_seq = 1;
    uint64_t buffer_bytes = 0;
    uint64_t mtp_bytes = 0;    // the MTP head's weights and per-sequence state (SessionOptions::mtp)
    uint64_t fixed_bytes = 0;  // dense + kv + buffers + mtp
    uint64_t slot_bytes = 0;   // one expert slot (0 for a dense model)
    uint64_t n_staging = 0;    // predictor staging slots
    uint64_t n_min_slots = 0;  // top-k + staging
    uint64_t minimum_bytes = 0;
    bool latent_kv = false;  // MLA (deepseek2): one latent row per position in type_k, no separate V
    // "dense weights X + KV cache Y (n_ctx N, K f16, V f16 | MLA latent f16) + buffers Z + k expert slots ...
    // = M"
    std::string describe(int64_t n_ctx, GgmlType type_k, GgmlType type_v) const;
};

MemoryPlan plan_memory(const Model& model, const MemoryPlanRequest& request);

}  // namespace sharpi
