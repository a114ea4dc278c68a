#include "moe/expert_tier.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>

#include "io/cufile_probe.h"
#include "moe/expert_layout.h"
#include "sharpi/errors.h"

namespace sharpi {

namespace {

class MappedSlotMemory final : public SlotMemory {
  public:
    explicit MappedSlotMemory(uint64_t bytes) {
        void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                         -1, 0);
        if (p == MAP_FAILED)
            throw IoError("[cache] cannot reserve " + std::to_string(bytes) + " bytes of expert slots");
        data_ = static_cast<uint8_t*>(p);
        bytes_ = bytes;
    }
    ~MappedSlotMemory() override { ::munmap(data_, bytes_); }
};

// The copy tier's filler: a queue of copies, executed in priority order (demand first, then by
// submission) when the cache reaps. Nothing runs concurrently, so cancel() succeeds for every request
// not yet reaped and busy time is zero.
class HostCopyFiller final : public ExpertReader {
  public:
    explicit HostCopyFiller(HostImages source) : source_(std::move(source)) {}
    const char* name() const override { return "host copy"; }
    void submit(const ReadRequest& r) override {
        if (r.file >= source_.images.size() || r.offset + r.length > source_.sizes[r.file]) {
            throw InvalidArgument("[copy] request [" + std::to_string(r.offset) + ", +" +
                                  std::to_string(r.length) + ") of file " + std::to_string(r.file) +
                                  " is outside the host images");
        }
        queue_.push_back(r);
        inflight_ += r.length;
    }
    bool cancel(uint64_t tag) override {
        const auto it = find(tag);
        if (it == queue_.end()) return false;
        inflight_ -= it->length;
        queue_.erase(it);
        return true;
    }
    void promote(uint64_t tag) override {
        const auto it = find(tag);
        if (it != queue_.end()) it->priority = ReadPriority::demand;
    }
    size_t reap(std::vector<ReadCompletion>& out, bool wait) override {
        if (plugged_ && !wait) return 0;  // a plugged queue starts nothing until unplug (or a waiting reap)
        plugged_ = false;
        std::stable_sort(queue_.begin(), queue_.end(),
                         [](const ReadRequest& a, const ReadRequest& b) { return a.priority < b.priority; });
        const size_t n = queue_.size();
        for (const ReadRequest& r : queue_) {
            std::memcpy(r.buffer + r.offset % kAlignment, source_.images[r.file] + r.offset, r.length);
            out.push_back(ReadCompletion{r.tag, true, ""});
            copied_ += r.length;
        }
        queue_.clear();
        inflight_ = 0;
        return n;
    }
    size_t reap_for(std::vector<ReadCompletion>& out, double) override { return reap(out, true); }
    size_t outstanding() const override { return queue_.size(); }
    uint64_t inflight_bytes() const override { return inflight_; }
    double busy_ms() const override { return 0.0; }
    double bytes_per_ms() const override { return copied_ > 0 ? 1e12 : 0.0; }  // memcpy: never the bottleneck
    void plug() override { plugged_ = true; }
    void unplug() override { plugged_ = false; }
    std::string describe() const override { return "host copy (the VRAM tier's bookkeeping in host memory)"; }

  private:
    std::deque<ReadRequest>::iterator find(uint64_t tag) {
        return std::find_if(queue_.begin(), queue_.end(),
                            [tag](const ReadRequest& r) { return r.tag == tag; });
    }
    HostImages source_;
    std::deque<ReadRequest> queue_;
    uint64_t inflight_ = 0, copied_ = 0;
    bool plugged_ = false;
};

class AlignedSlotMemory final : public SlotMemory {
  public:
    explicit AlignedSlotMemory(uint64_t bytes) {
        data_ = static_cast<uint8_t*>(std::aligned_alloc(ExpertReader::kAlignment, bytes));
        if (data_ == nullptr)
            throw IoError("[cache] cannot allocate " + std::to_string(bytes) + " bytes of expert slots");
        bytes_ = bytes;
    }
    ~AlignedSlotMemory() override { std::free(data_); }
};

}  // namespace

ExpertTier ram_tier(const std::vector<std::string>& files, const std::string& reader) {
    ExpertTier t;
    t.name = "ram";
    if (reader == "auto") {
        const CufileProbe probe = probe_cufile();
        t.reader_note = probe.usable ? "cuFile (" + probe.library + ") fills VRAM slots, not RAM ones"
                                     : "cuFile unavailable: " + probe.why;
    }
    t.allocate = [](uint64_t bytes) -> std::unique_ptr<SlotMemory> {
        return std::make_unique<MappedSlotMemory>(bytes);
    };
    t.open_filler = [files, reader](uint8_t* arena, uint64_t bytes) {
        return make_expert_reader(reader, files, arena, bytes, ReaderOptions{});
    };
    return t;
}

HostImages mapped_images(const ExpertLayout& layout) {
    HostImages out;
    out.images.assign(layout.files.size(), nullptr);
    out.sizes.assign(layout.files.size(), 0);
    for (const ExpertLayerLayout& x : layout.layers) {
        if (!x.present()) continue;
        for (const ExpertPart& part : x.parts) {
            if (part.view.data == nullptr) throw InvalidArgument("[copy] the model's experts are not mapped");
            out.images[part.file] = part.view.data - part.offset;
            const uint64_t end = part.offset + part.bytes * static_cast<uint64_t>(layout.n_expert);
            out.sizes[part.file] = std::max(out.sizes[part.file], end);
        }
    }
    return out;
}

ExpertTier copy_tier(const HostImages& source) {
    ExpertTier t;
    t.name = "copy";
    t.allocate = [](uint64_t bytes) -> std::unique_ptr<SlotMemory> {
        return std::make_unique<AlignedSlotMemory>(bytes);
    };
    t.open_filler = [source](uint8_t*, uint64_t) -> std::unique_ptr<ExpertReader> {
        return std::make_unique<HostCopyFiller>(source);
    };
    return t;
}

}  // namespace sharpi
