// The tier planner (docs/design.md §2, §10): given a VRAM budget, a RAM budget and the model's sizes,
// decide what lives where when a GPU computes.
//
//   VRAM: the dense weights, the KV cache and the activation buffers (always; the device forward pass
//         needs them every token), then the routed experts: all of them when they fit ("resident"),
//         otherwise a pool of expert slots (the VRAM tier of the slot cache), a few staging slots for
//         prefetch, and, when a prior (a harvested trace's per-expert use) is given, the hottest experts
//         pinned outside the policy.
//   RAM:  the host buffers of CPU compute of misses, then the experts VRAM does not pin: every one of
//         them when ram_budget is 0 (the file mapped, pinned for the copy stream) or when the budget
//         holds them all, otherwise a pool of RAM slots (the host tier of the same cache).
//   disk: what RAM does not hold, read on demand by the reader.
//
// Pure arithmetic on a TierSizes (tier_sizes() fills one from a model through the device and RAM
// planners, so the numbers are the ones those planners charge), so host tests check every decision
// on synthetic sizes. An impossible budget is an InvalidArgument that names the budget, the minimum
// and what the minimum is made of.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moe/replacement_policy.h"
#include "quant/ggml_type.h"

namespace sharpi {
struct Model;

struct TierSizes {
    int64_t n_layer = 0;        // model layers (the prior's rows)
    int64_t n_moe_layer = 0;    // layers with routed experts
    int64_t n_expert = 0;       // experts per MoE layer
    int64_t n_expert_used = 0;  // top-k
    // Bytes of each MoE layer's one expert (gate + up + down as in the file), [n_layer], 0 for a dense
    // layer.
    std::vector<uint64_t> expert_bytes;
    // One slot of each tier: ExpertCache::slot_bytes, the largest expert with each part's 4 KiB-aligned
    // superset (the VRAM tier is the same cache, so its slots have the same layout).
    uint64_t host_slot_bytes = 0;
    uint64_t vram_slot_bytes = 0;
    // What VRAM always holds (cuda::plan_device_model's charges).
    uint64_t device_dense_bytes = 0, device_kv_bytes = 0, device_buffer_bytes = 0;
    // What RAM always holds when a GPU computes: the activation buffers of the CPU path (CPU compute of
    // misses). Dense weights are not charged: they are uploaded from the mapping and not touched again.
    uint64_t host_fixed_bytes = 0;

    uint64_t expert_total_bytes() const;  // every routed expert of every layer
};

struct TierRequest {
    uint64_t vram_budget = 0;  // bytes, > 0 (resolve `auto` with auto_vram_budget first)
    uint64_t ram_budget = 0;   // bytes; 0: every expert in RAM (the file mapped)
    uint64_t n_staging = 0;    // VRAM prefetch staging slots (lookahead * top-k; 0 without a predictor)
    // A harvested prior, [n_layer * n_expert] (gguf/cache_prior_file.h), or empty: with it, part of the
    // VRAM expert capacity pins the experts it ranks hottest.
    std::vector<float> prior;
    // Share of the slots beyond the minimum (top-k) given to pinned experts when a prior is given,
    // in [0, 1] (the same knob as the "prior" replacement policy's prior_pin).
    double pin_share = 0.5;
};

struct TierPlan {
    // VRAM
    uint64_t vram_budget = 0;
    uint64_t device_dense_bytes = 0, device_kv_bytes = 0, device_buffer_bytes = 0;
    bool experts_resident = false;       // every routed expert fits: no slots, nothing streams to VRAM
    std::vector<ExpertKey> vram_pinned;  // hottest experts by the prior, never evicted (not when resident)
    uint64_t vram_slot_bytes = 0;
    uint64_t n_vram_slots = 0;  // slots under the replacement policy
    uint64_t n_vram_staging = 0;
    uint64_t vram_expert_bytes = 0;  // resident experts, or (pinned + slots + staging) * slot bytes
    uint64_t vram_minimum_bytes = 0;
    uint64_t vram_bytes() const {
        return device_dense_bytes + device_kv_bytes + device_buffer_bytes + vram_expert_bytes;
    }
    // RAM
    uint64_t ram_budget = 0;
    uint64_t host_fixed_bytes = 0;
    bool ram_holds_all = false;  // every expert VRAM does not hold is in RAM (mapped or in slots)
    uint64_t n_ram_slots = 0;    // RAM slots when RAM streams from disk (0 when ram_holds_all)
    uint64_t host_slot_bytes = 0;
    uint64_t ram_expert_bytes = 0;
    uint64_t ram_minimum_bytes = 0;  // 0 without a RAM budget
    // disk
    uint64_t n_experts_total = 0;
    uint64_t n_experts_on_disk_only = 0;  // experts neither pinned in VRAM nor held by RAM at any one time

    // Several lines, one per tier.
    std::string describe() const;
};

// Throws InvalidArgument when the VRAM budget does not hold dense + KV + buffers + top-k slots (+
// staging), when the RAM budget does not hold its buffers and top-k slots, or for a prior of the
// wrong shape or a pin share outside [0, 1].
TierPlan plan_tiers(const TierSizes& sizes, const TierRequest& request);

// The sizes of a loaded (or only mapped) model for a session of n_ctx positions and batches of
// max_batch: throws what cuda::plan_device_model throws for what the device path does not compute.
TierSizes tier_sizes(const Model& model, int64_t n_ctx, int64_t max_batch, GgmlType type_k, GgmlType type_v);

// `--vram-budget auto`: free VRAM minus a margin of max(512 MiB, 5 % of free) for the CUDA context,
// the allocator's rounding and other processes' growth. Throws InvalidArgument when nothing is left.
struct AutoVramBudget {
    uint64_t budget = 0, free = 0, margin = 0;
    std::string describe() const;
};
AutoVramBudget auto_vram_budget(uint64_t vram_free);

}  // namespace sharpi
