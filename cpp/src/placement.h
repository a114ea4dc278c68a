// The placement planner: from a session's options, its model and what the machine offers, where every
// part of the model lives and how big each cache is, decided before anything is allocated. The engine
// (engine.h) checks the options, plans, then builds what the Placement says; it makes none of these
// decisions itself.
//
//   check_session_options: n_ctx and threads, before anything is read.
//   resolve_ram_budget:    ram_budget "auto" to bytes (ram_budget.h). It runs before the model is
//                          loaded: the budget is what the process may still take, and the dense weights
//                          the session reads are charged inside it, not measured out of it.
//   check_options_for_model: the names and combinations of the other options, once the model is
//                          open (a missing model file is reported before a bad option, as ever).
//   plan_placement:        the KV cache types and context, the RAM tier (memory_plan.h: dense, KV cache
//                          and buffers charged first, the rest expert slots), the device and its VRAM
//                          tier (tier_plan.h, vram_budget "auto" from the device's free VRAM), CPU
//                          compute of VRAM misses, each cache's policy, and whether a predictor has a
//                          tier to prefetch into. Throws InvalidArgument naming the minimum of a budget
//                          that is too small, UnsupportedError / DeviceError for what the device path
//                          cannot do, before anything is allocated.
//
// The machine is asked only when an option says "auto" (MachineProbe), so a plan is pure arithmetic
// on the model's sizes otherwise.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "backend/cuda_interface.h"
#include "model/model.h"
#include "moe/cpu_miss.h"
#include "moe/expert_cache.h"
#include "quant/ggml_type.h"
#include "sharpi/options.h"

namespace sharpi {

// What the planner reads from the machine, only for "auto" budgets (the real probes by default).
struct MachineProbe {
    std::function<AutoRamBudget()> ram_auto;        // ram_budget.h auto_ram_budget()
    std::function<cuda::DeviceInfo()> device_info;  // cuda::device_info()
    MachineProbe();
};

// n_ctx beyond the trained context (GGUF <arch>.context_length) is an InvalidArgument unless
// allow_long_context (llama.cpp only warns; sharpi refuses, since the output is garbage).
void check_context_size(int64_t n_ctx, int64_t n_ctx_train, bool allow_long_context, const std::string& path);

// n_ctx and threads >= 0. Throws InvalidArgument.
void check_session_options(const SessionOptions& options);

// ram_budget in bytes (0: every expert resident), with how "auto" was chosen when it was asked for.
struct RamBudget {
    uint64_t bytes = 0;
    std::optional<AutoRamBudget> auto_choice;
};
RamBudget resolve_ram_budget(const SessionOptions& options, const MachineProbe& probe);

// A RAM budget only for a model with routed experts, the device's name, vram_budget only with device
// "cuda", a predictor only with a budget, the cache policy and prefetch sizing names, a custom
// predictor's lookahead. Throws InvalidArgument.
void check_options_for_model(const SessionOptions& options, const RamBudget& ram, const Model& model);

struct Placement {
    // Exact mode: SessionOptions::exact, or SHARPI_EXACT=1 in the environment.
    bool exact = false;
    int64_t n_ctx = 0;
    // The KV cache's element types as requested (the host KV cache's; the device keeps its own below).
    GgmlType type_k = GgmlType::F32, type_v = GgmlType::F32;

    // RAM: the routed experts stream from the file into RAM slots (ram_cache, sized from the budget),
    // or every expert stays resident (mapped).
    bool ram_streams = false;
    ExpertCacheOptions ram_cache;

    // device="cuda": the device forward pass with its KV cache types, and, when the experts stream
    // through VRAM, the VRAM tier's cache (its slots from the tier plan).
    bool on_device = false;
    GgmlType device_type_k = GgmlType::F32, device_type_v = GgmlType::F32;
    bool vram_streams = false;
    ExpertCacheOptions vram_cache;
    CpuMissOptions misses;  // how VRAM misses are served; `pool` is the engine's to set

    // What expert_stats() reports of the plan: the budget the slots were sized from and the bytes
    // charged before them (dense weights, KV cache, buffers).
    uint64_t budget_bytes = 0, fixed_bytes = 0;

    // A predictor is installed only where the experts stream through a tier: elsewhere it would have
    // nothing to prefetch (check_session_options and plan_placement refuse a named predictor there).
    bool prefetches() const { return ram_streams || vram_streams; }
};

// The plan of a session of `options` (checked above) on `model` (loaded with streaming = ram.bytes > 0),
// in batches of max_batch tokens.
Placement plan_placement(const SessionOptions& options, const RamBudget& ram, const Model& model,
                         int64_t max_batch, const MachineProbe& probe);

}  // namespace sharpi
