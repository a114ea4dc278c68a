// The compute side's view of the VRAM tier (device_tier.cu): how the forward pass makes its compute
// stream wait on exactly the copies a layer reads, and marks where those reads end so that a slot is
// refilled only after them. The tier itself is an ExpertCache (moe/expert_cache.h) whose filler copies
// on a copy stream; the cache owns the filler, the forward pass only borrows it through VramFills.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "moe/expert_tier.h"

namespace sharpi {
class ExpertCache;
struct ExpertLayout;
class Timeline;
}  // namespace sharpi

namespace sharpi::cuda {

struct DeviceClock;  // device_memory.cuh

class VramFills {
  public:
    virtual ~VramFills() = default;
    // Work queued on `compute` after this call waits for the copy of `tag` if it is still in flight
    // (nothing to wait for once it completed).
    virtual void stream_wait(uint64_t tag, cudaStream_t compute) const = 0;
    // Marks the end of the reads queued on `compute` so far: copies issued from now on wait for it.
    // Call it after the last launch that reads the acquired slots and before ExpertCache::release.
    virtual void compute_done(cudaStream_t compute) = 0;
    // With an enabled timeline, every copy started from now on is timed on the device and becomes a
    // span on the "copy stream" track when it is reaped, placed on the host clock by `clock` (both
    // outlive the filler or are detached with nullptr first).
    virtual void set_timeline(Timeline* timeline, const DeviceClock* clock) = 0;
};

// The VRAM tier over the files of `layout`, filled by the source `reader` names (fill_source.cuh):
// "cufile" cuFile reads (a typed error where cuFile cannot run), "auto" cuFile where GPUDirect
// Storage is present and copies from the pinned mapping otherwise (ExpertTier::reader_note says
// which and why), any other reader the copies. *fills receives the filler the cache opens, which
// lives as long as the cache.
ExpertTier vram_tier(const ExpertLayout& layout, const std::string& reader, VramFills** fills);

// Makes `compute` wait on every part's copy of the n experts of the cache's last acquire.
void stream_wait_acquired(const ExpertCache& cache, const VramFills& fills, int n, cudaStream_t compute);

}  // namespace sharpi::cuda
