// CPU compute of VRAM misses, the host half (docs/design.md §10, issue 22): when the gate selects an expert
// that is not in a VRAM slot, the device forward pass either copies it (the VRAM tier's copy stream)
// or computes it here on the CPU from the host tier's bytes and sends one output row back up. This
// file holds what needs no device: the route of each selected expert of a layer, and the CPU side
// of the cost model's inputs (how fast the CPU expert kernel runs, timed on the model's own bytes).
// The device side (cuda/device_forward.cu) times its copies and does the transfers.
//
// Modes: "copy" (the default: every miss is copied and computed by the device kernels, so streamed
// logits equal resident ones bit for bit), "cpu" (every miss computed on the CPU; SHARPI_CPU_MOE=1),
// "auto" (per expert, moe/miss_cost.h's choose_miss_route on the measured or given bandwidths). The
// CPU kernels sum in another order than the device's, so "cpu" and "auto" hold the logits to the
// GPU-vs-CPU budget, not to the bits; that is why they are opt-in.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moe/miss_cost.h"

namespace sharpi {
struct ExpertLayout;
class ThreadPool;

enum class MissMode { copy, cpu, cost };

// How a streamed device session serves its VRAM misses (open_device_forward's `misses`).
struct CpuMissOptions {
    MissMode mode = MissMode::copy;
    // The cost model's inputs; 0: measured when the device forward pass opens (timed copies of one
    // expert from the pinned mapping into VRAM; measure_cpu_expert_speed on `pool`).
    double copy_bytes_per_s = 0.0;
    double cpu_bytes_per_s = 0.0;
    double copy_latency_s = -1.0;  // < 0: measured (a timed copy of a few bytes)
    ThreadPool* pool = nullptr;    // the session's pool, for the CPU kernels; required unless mode is copy
};

// "copy", "cpu" or "auto" (MissMode::cost); InvalidArgument otherwise.
MissMode parse_miss_mode(const std::string& name);
const char* miss_mode_name(MissMode mode);

// The route of each of n selected experts of one layer: an expert the VRAM tier holds or is loading
// (present[i]) is always computed on the device; a miss by the mode: copy, cpu, or the cost model on
// `inputs` (one expert of this layer, the rows routed to it: n_tokens). Throws what
// choose_miss_route throws (MissMode::cost only).
std::vector<MissRoute> route_misses(MissMode mode, const std::vector<bool>& present,
                                    const MissCostInputs& inputs);

// Weight bytes per second the CPU expert kernel (cpu::expert_ffn_one_token, one activation row)
// reaches on expert 0 of the first MoE layer of `layout` (its host bytes, which must be mapped):
// the median of `repeats` timed runs after one untimed one, on `pool`, in exact or fast mode.
// InvalidArgument for a model without routed experts or repeats < 1.
double measure_cpu_expert_speed(const ExpertLayout& layout, int64_t n_embd, ThreadPool& pool, bool exact,
                                int repeats = 5);

}  // namespace sharpi
