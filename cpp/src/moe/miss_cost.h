// The cost model of a VRAM miss (docs/design.md §10, Fiddler's fallback): when the gate selects an expert
// that is not in a VRAM slot, either copy it over PCIe from the host tier and compute it on the GPU, or
// compute it on the CPU where its bytes already are and move only the activations (the rows routed to
// it down, its output rows back up). Both produce the same expert output; this decides per expert,
// per layer, which costs less time now.
//
//   copy: copy_latency + expert_bytes / copy_bandwidth
//   cpu:  2 * copy_latency + 2 * n_tokens * row_bytes / copy_bandwidth + n_tokens * expert_bytes /
//   cpu_bandwidth
//
// cpu_bandwidth is the CPU expert kernel's measured speed in weight bytes per second for one row: a
// decode-time expert product streams every weight byte once per row, so its time is bytes over
// bandwidth. Charging the CPU that per row for a batch is conservative (a batched CPU product reuses
// weights from cache); it makes prefill copy, as it should: the GPU then computes every row at once.
// The inputs are measurements (the copy stream's bandwidth and the CPU kernel's speed, taken when the
// device forward pass opens), so the model is plain arithmetic and the host tests check its choices.
#pragma once

#include <cstdint>

namespace sharpi {

struct MissCostInputs {
    uint64_t expert_bytes = 0;      // one expert's gate + up + down bytes as in the file
    int64_t n_embd = 0;             // activation row width (f32 elements), down and back up
    int64_t n_tokens = 1;           // rows of the batch routed to this expert, >= 1
    double copy_bytes_per_s = 0.0;  // measured host -> device bandwidth from pinned memory, > 0
    double copy_latency_s = 0.0;    // fixed cost of one transfer (launch, DMA setup, event), >= 0
    double cpu_bytes_per_s = 0.0;   // measured CPU expert kernel speed, weight bytes per second per row, > 0
};

enum class MissRoute { copy, cpu };

struct MissCost {
    MissRoute route = MissRoute::copy;
    double copy_s = 0.0;  // the copy's modelled time
    double cpu_s = 0.0;   // the CPU path's modelled time (compute + both activation transfers)
};

// Throws InvalidArgument for a bandwidth <= 0, a negative latency, n_tokens < 1 or n_embd < 1.
// Ties go to the copy (it also leaves the expert in VRAM for the next token).
MissCost choose_miss_route(const MissCostInputs& in);

const char* miss_route_name(MissRoute route);

}  // namespace sharpi
