// Where the VRAM tier's fills come from (device_tier.cu's StreamFiller, one per cache). A source
// queues one request's bytes into device slot memory on the copy stream; the filler records an event
// after it and owns everything else (queue, priorities, cancel, completions, timeline), so every
// source has the same ordering guarantees:
//   pinned copy  cudaMemcpyAsync from the model's mapping, registered as pinned host memory;
//   cufile       cuFileReadAsync from the files into the slot (GPUDirect Storage where the platform
//                has it, cuFile's compatibility mode otherwise), cufile_source.cu.
// A source is used from the decode thread only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "io/expert_reader.h"
#include "moe/expert_tier.h"

namespace sharpi::cuda {

// State one queued fill needs until its event completed (cuFile reads its arguments through
// pointers when the stream reaches the read, and writes the byte count back).
struct FillState {
    virtual ~FillState() = default;
};

class FillSource {
  public:
    virtual ~FillSource() = default;
    virtual const char* name() const = 0;  // ExpertCacheStats::reader
    virtual std::string describe() const = 0;
    // Queues the fill of r (r.length bytes of file r.file at r.offset, delivered at
    // r.buffer + r.offset % kAlignment) on `stream`. Throws InvalidArgument for a request outside the
    // files, DeviceError when the queueing itself fails.
    virtual std::unique_ptr<FillState> enqueue(const ReadRequest& r, cudaStream_t stream) = 0;
    // After the fill's event completed without a CUDA error: "" when the bytes arrived, else why not.
    virtual std::string check(const ReadRequest& r, const FillState* state) const = 0;
};

// cudaMemcpyAsync from `images` (the model's mapping), which it registers as pinned host memory.
std::unique_ptr<FillSource> pinned_copy_source(const HostImages& images);

// Whether `--reader auto` takes cuFile for the VRAM tier, and why (or why not): cuFile must be
// usable (io/cufile_probe.h) and GPUDirect Storage present (the nvidia-fs driver); in compatibility
// mode cuFile reads through bounce buffers, and the pinned mapping is copied directly instead.
struct CufileChoice {
    bool use = false;
    std::string why;
};
CufileChoice choose_cufile_for_auto();

// cuFileReadAsync from `files` (opened O_DIRECT where the file system allows it). UnsupportedError
// when cuFile cannot run here (the probe's reason) or this build has no cufile.h; DeviceError when
// the cuFile driver or a file registration fails (with cuFile's error).
std::unique_ptr<FillSource> cufile_source(const std::vector<std::string>& files);

}  // namespace sharpi::cuda
