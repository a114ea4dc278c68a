// ExpertTier: what makes one ExpertCache the RAM tier or the VRAM tier (docs/design.md §2, §11: one cache
// implementation, parameterised by tier). The slot bookkeeping, the replacement policy, staging and
// adoption, and the counters (docs/design.md §7) are ExpertCache's and identical in every tier; a tier only
// says where the slot arena lives and what fills a slot:
//
//   tier  | slot arena                           | filler (an ExpertReader over the arena)
//   ram   | anonymous mapping (pinned for a GPU)  | the file reader: io_uring or pread, from disk
//   vram  | one device allocation (cuda/)         | the copy stream: cudaMemcpyAsync from the host tier's
//         |                                       | bytes, one cudaEvent per copy (cuda/device_tier.cu)
//   copy  | host allocation                       | memcpy from host images of the files: the VRAM tier's
//         |                                       | bookkeeping with host memory, for host tests
//
// A filler honours the ExpertReader contract (priorities, plug, cancel before start, completions only
// through reap, the requested bytes at buffer + offset % kAlignment), so the cache cannot tell tiers
// apart. The arena outlives the filler (ExpertCache destroys the filler first).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "io/expert_reader.h"

namespace sharpi {

// One tier's slot arena: `bytes` bytes at `data`, kAlignment-aligned; freed by the destructor.
class SlotMemory {
  public:
    virtual ~SlotMemory() = default;
    uint8_t* data() const { return data_; }
    uint64_t bytes() const { return bytes_; }

  protected:
    uint8_t* data_ = nullptr;
    uint64_t bytes_ = 0;
};

struct ExpertTier {
    std::string name;  // "ram", "vram" or "copy": ExpertCacheStats::tier
    // ExpertCacheStats::reader_note: the readers `auto` passed over and why (the RAM tier: cuFile's probe).
    std::string reader_note;
    std::function<std::unique_ptr<SlotMemory>(uint64_t bytes)> allocate;
    std::function<std::unique_ptr<ExpertReader>(uint8_t* arena, uint64_t arena_bytes)> open_filler;
};

// The RAM tier: an anonymous mapping (pages touched only when filled), filled from `files` by the
// reader of that kind (make_expert_reader: "auto", "uring" or "pread").
ExpertTier ram_tier(const std::vector<std::string>& files, const std::string& reader);

// Host images of the model's files, by file index (the mapped shards): what a copy tier copies from.
// images[f] + offset is byte `offset` of file f; sizes[f] its length.
struct HostImages {
    std::vector<const uint8_t*> images;
    std::vector<uint64_t> sizes;
};

// The images of a model's expert ranges in its file mapping (the parts' views minus their offsets);
// ranges are bounded by the experts' extent in each file. Throws InvalidArgument when the layout is
// not mapped (a streaming model).
struct ExpertLayout;
HostImages mapped_images(const ExpertLayout& layout);

// The copy tier: the VRAM tier's fill path with host memory on both sides. Its filler queues copies
// and performs them, demand before prefetch, at reap(); it never blocks.
ExpertTier copy_tier(const HostImages& source);

}  // namespace sharpi
