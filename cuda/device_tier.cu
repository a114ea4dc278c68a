// The VRAM tier of the expert cache (moe/expert_tier.h, docs/design.md §10): ExpertCache's own bookkeeping
// and replacement policy over slots in device memory, filled on a dedicated copy stream from a FillSource
// (fill_source.cuh: copies from the pinned mapping, or cuFile reads from the files).
//
// Owns: the slot arena (one cudaMalloc), the copy stream, one event per fill in flight (pooled), and
// the fill source (which owns the host registration of the mapping, or the cuFile handles). Called from the
// decode thread only, like the cache. What overlaps what: a copy runs on the copy stream while the compute
// stream computes earlier layers; the compute stream waits on exactly the events of the slots a layer reads
// (stream_wait), and the host never synchronizes the device in the decode loop (reap polls events; it blocks
// on one event only when the cache must have a slot and every candidate is still being filled). Must never:
// overwrite a slot that queued compute may still read. Slots are evicted only between layers, after the
// caller marked the end of the last layer's reads with compute_done(); every copy issued after that waits on
// that mark on the copy stream, so a reused slot is written only once the kernels that read its previous
// expert have run.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "backend/cuda_interface.h"
#include "device_memory.cuh"
#include "device_tier.cuh"
#include "fill_source.cuh"
#include "io/expert_reader.h"
#include "model/model.h"
#include "moe/expert_cache.h"
#include "moe/expert_tier.h"
#include "sharpi/errors.h"
#include "trace/timeline.h"

namespace sharpi::cuda {
namespace {

using Clock = std::chrono::steady_clock;

class DeviceSlotMemory final : public SlotMemory {
  public:
    explicit DeviceSlotMemory(uint64_t bytes) : buffer_(bytes, "VRAM expert slots") {
        data_ = buffer_.as<uint8_t>();
        bytes_ = bytes;
    }

  private:
    DeviceBuffer buffer_;
};

class PinnedCopySource final : public FillSource {
  public:
    explicit PinnedCopySource(const HostImages& images) : images_(images) {
        for (size_t f = 0; f < images_.images.size(); ++f) {
            if (images_.images[f] == nullptr) continue;
            // Pinned sources make the copies truly asynchronous; a mapping the driver will not
            // register still copies correctly (staged by the driver), only slower.
            void* p = const_cast<uint8_t*>(images_.images[f]);
            if (cudaHostRegister(p, images_.sizes[f], cudaHostRegisterReadOnly) == cudaSuccess) {
                registered_.push_back(p);
            } else {
                cudaGetLastError();
            }
        }
    }
    ~PinnedCopySource() override {
        for (void* p : registered_) cudaHostUnregister(p);
    }
    const char* name() const override { return "cuda copy"; }
    std::string describe() const override {
        return std::string("cuda copy: cudaMemcpyAsync from the mapping on a copy stream, source ") +
               (registered_.size() == images_.images.size() ? "pinned (cudaHostRegister)"
                                                            : "partly pageable (registration refused)");
    }
    std::unique_ptr<FillState> enqueue(const ReadRequest& r, cudaStream_t stream) override {
        if (r.file >= images_.images.size() || images_.images[r.file] == nullptr ||
            r.offset + r.length > images_.sizes[r.file]) {
            throw InvalidArgument("[cuda] copy request [" + std::to_string(r.offset) + ", +" +
                                  std::to_string(r.length) + ") of file " + std::to_string(r.file) +
                                  " is outside the host images");
        }
        cuda_check(
            cudaMemcpyAsync(r.buffer + r.offset % ExpertReader::kAlignment, images_.images[r.file] + r.offset,
                            r.length, cudaMemcpyHostToDevice, stream),
            "copy to device: expert fill");
        return nullptr;
    }
    std::string check(const ReadRequest&, const FillState*) const override { return ""; }

  private:
    HostImages images_;
    std::vector<void*> registered_;
};

// ExpertReader over a FillSource: a request is one fill queued on the copy stream plus an event
// recorded after it. Queued (plugged, or behind the priority sort) requests can be cancelled or
// promoted; started ones complete when their event does.
class StreamFiller final : public ExpertReader, public VramFills {
  public:
    explicit StreamFiller(std::shared_ptr<FillSource> source) : source_(std::move(source)) {}
    ~StreamFiller() override {
        // No fill may still write into the arena or read its source's state.
        cudaStreamSynchronize(copy_.get());
    }

    const char* name() const override { return source_->name(); }
    void submit(const ReadRequest& r) override {
        queued_.push_back(r);
        inflight_bytes_ += r.length;
        note_busy();
        if (!plugged_) start_queued();
    }
    bool cancel(uint64_t tag) override {
        const auto it = std::find_if(queued_.begin(), queued_.end(),
                                     [tag](const ReadRequest& r) { return r.tag == tag; });
        if (it == queued_.end()) return false;
        inflight_bytes_ -= it->length;
        queued_.erase(it);
        return true;
    }
    void promote(uint64_t tag) override {
        for (ReadRequest& r : queued_) {
            if (r.tag == tag) r.priority = ReadPriority::demand;
        }
    }
    size_t reap(std::vector<ReadCompletion>& out, bool wait) override {
        if (wait) plugged_ = false;
        if (!plugged_) start_queued();
        size_t n = collect(out);
        if (n == 0 && wait && !started_.empty()) {
            started_.front().done.synchronize();
            n = collect(out);
        }
        return n;
    }
    size_t reap_for(std::vector<ReadCompletion>& out, double timeout_ms) override {
        plugged_ = false;
        start_queued();
        const auto until = Clock::now() + std::chrono::duration<double, std::milli>(timeout_ms);
        for (;;) {
            const size_t n = collect(out);
            if (n > 0 || started_.empty() || Clock::now() >= until) return n;
            std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
    }
    size_t outstanding() const override { return queued_.size() + started_.size(); }
    uint64_t inflight_bytes() const override { return inflight_bytes_; }
    double busy_ms() const override {
        double ms = busy_ms_;
        if (outstanding() > 0)
            ms += std::chrono::duration<double, std::milli>(Clock::now() - busy_since_).count();
        return ms;
    }
    double bytes_per_ms() const override {
        const double ms = busy_ms();
        return ms > 0.0 ? static_cast<double>(copied_bytes_) / ms : 0.0;
    }
    void plug() override { plugged_ = true; }
    void unplug() override {
        plugged_ = false;
        start_queued();
    }
    std::string describe() const override { return source_->describe() + ", one event per fill"; }

    void stream_wait(uint64_t tag, cudaStream_t compute) const override {
        for (const Started& s : started_) {
            if (s.request.tag == tag)
                cuda_check(cudaStreamWaitEvent(compute, s.done.get(), 0), "cudaStreamWaitEvent");
        }
    }
    void set_timeline(Timeline* timeline, const DeviceClock* clock) override {
        timeline_ = timeline;
        clock_ = clock;
    }
    void compute_done(cudaStream_t compute) override {
        cuda_check(cudaEventRecord(compute_done_.get(), compute), "cudaEventRecord (compute done)");
        compute_marked_ = true;
    }

  private:
    struct Started {
        ReadRequest request;
        std::unique_ptr<FillState> state;  // the source's, alive until `done` completed
        Event done;
        std::unique_ptr<Event> timed_begin, timed_end;  // timeline only
    };

    void note_busy() {
        if (outstanding() == 1) busy_since_ = Clock::now();
    }
    void start_queued() {
        std::stable_sort(queued_.begin(), queued_.end(),
                         [](const ReadRequest& a, const ReadRequest& b) { return a.priority < b.priority; });
        for (const ReadRequest& r : queued_) {
            if (compute_marked_) copy_.wait(compute_done_.get());
            const bool timed = timeline_ != nullptr && timeline_->enabled() && clock_ != nullptr;
            std::unique_ptr<Event> begin = timed ? std::make_unique<Event>(true) : nullptr;
            if (begin) begin->record(copy_);
            std::unique_ptr<FillState> state = source_->enqueue(r, copy_.get());
            std::unique_ptr<Event> end = timed ? std::make_unique<Event>(true) : nullptr;
            if (end) end->record(copy_);
            Event done = take_event();
            done.record(copy_);
            started_.push_back(
                Started{r, std::move(state), std::move(done), std::move(begin), std::move(end)});
        }
        queued_.clear();
    }
    size_t collect(std::vector<ReadCompletion>& out) {
        size_t n = 0;
        // Copies on one stream complete in order: stop at the first still running.
        while (!started_.empty()) {
            const cudaError_t err = cudaEventQuery(started_.front().done.get());
            if (err == cudaErrorNotReady) break;
            Started s = std::move(started_.front());
            started_.pop_front();
            ReadCompletion c{s.request.tag, err == cudaSuccess, ""};
            if (err != cudaSuccess) {
                cudaGetLastError();
                c.error = cuda_error_message(err, std::string("expert fill (") + source_->name() + ")");
            } else {
                c.error = source_->check(s.request, s.state.get());
                c.ok = c.error.empty();
            }
            out.push_back(std::move(c));
            if (s.timed_begin && err == cudaSuccess) {
                timeline_->span("copy stream", "fill " + std::to_string(s.request.length) + " B",
                                clock_->host_us(*s.timed_begin), clock_->host_us(*s.timed_end));
            }
            inflight_bytes_ -= s.request.length;
            copied_bytes_ += s.request.length;
            events_.push_back(std::move(s.done));
            ++n;
        }
        if (n > 0 && outstanding() == 0)
            busy_ms_ += std::chrono::duration<double, std::milli>(Clock::now() - busy_since_).count();
        return n;
    }
    Event take_event() {
        if (events_.empty()) return Event{};
        Event e = std::move(events_.back());
        events_.pop_back();
        return e;
    }

    std::shared_ptr<FillSource> source_;
    Timeline* timeline_ = nullptr;
    const DeviceClock* clock_ = nullptr;
    Stream copy_;
    Event compute_done_;
    bool compute_marked_ = false;
    std::deque<ReadRequest> queued_;
    std::deque<Started> started_;
    std::vector<Event> events_;  // completed events, reused
    bool plugged_ = false;
    uint64_t inflight_bytes_ = 0, copied_bytes_ = 0;
    double busy_ms_ = 0.0;
    Clock::time_point busy_since_{};
};

}  // namespace

std::unique_ptr<FillSource> pinned_copy_source(const HostImages& images) {
    return std::make_unique<PinnedCopySource>(images);
}

ExpertTier vram_tier(const ExpertLayout& layout, const std::string& reader, VramFills** fills) {
    const ReaderKind kind = parse_reader_kind(reader);  // the RAM tier's names and error
    ExpertTier t;
    t.name = "vram";
    bool use_cufile = kind == ReaderKind::cufile;
    if (kind == ReaderKind::automatic) {
        const CufileChoice choice = choose_cufile_for_auto();
        use_cufile = choice.use;
        t.reader_note = choice.why;
    } else if (!use_cufile) {
        t.reader_note =
            "reader '" + reader + "' reads into host memory; the VRAM tier copies from the pinned mapping";
    }
    // The source is made here, before the cache allocates anything, so that a cuFile that cannot run
    // is a typed error at open.
    std::shared_ptr<FillSource> source(use_cufile ? cufile_source(layout.files)
                                                  : pinned_copy_source(mapped_images(layout)));
    t.allocate = [](uint64_t bytes) -> std::unique_ptr<SlotMemory> {
        return std::make_unique<DeviceSlotMemory>(bytes);
    };
    t.open_filler = [source, fills](uint8_t*, uint64_t) mutable -> std::unique_ptr<ExpertReader> {
        if (source == nullptr) throw InvalidArgument("[cuda] the VRAM tier opens one filler");
        auto f = std::make_unique<StreamFiller>(std::move(source));
        *fills = f.get();
        return f;
    };
    return t;
}

void stream_wait_acquired(const ExpertCache& cache, const VramFills& fills, int n, cudaStream_t compute) {
    for (int i = 0; i < n; ++i) {
        for (int part = 0; part < kExpertParts; ++part) fills.stream_wait(cache.fill_tag(i, part), compute);
    }
}

VramTierRun op_vram_tier_run(const Model& model, const VramTierOptions& o,
                             const std::vector<TierStep>& steps) {
    require_device("VRAM expert tier");
    ExpertCacheOptions co;
    co.n_slots = o.n_slots;
    co.n_staging = o.n_staging;
    co.policy = o.policy;
    VramFills* filler = nullptr;
    ExpertCache cache(model.experts, co, vram_tier(model.experts, o.reader, &filler));
    Stream compute;
    VramTierRun run;
    std::vector<ExpertView> views;
    for (const TierStep& step : steps) {
        const int n = static_cast<int>(step.experts.size());
        views.assign(step.experts.size(), ExpertView{});
        cache.gate_fired(step.layer, step.experts.data(), n);
        cache.acquire(step.layer, step.experts.data(), n, views.data());
        // The compute stream waits on exactly the fills this step reads, then reads every slot back.
        stream_wait_acquired(cache, *filler, n, compute.get());
        std::vector<PinnedBuffer> back;
        for (int i = 0; i < n; ++i) {
            uint64_t bytes = 0;
            for (const WeightView* w : {&views[i].gate, &views[i].up, &views[i].down})
                bytes += static_cast<uint64_t>(w->n_rows) * w->row_bytes;
            back.emplace_back(bytes, "expert read-back");
            uint64_t at = 0;
            for (const WeightView* w : {&views[i].gate, &views[i].up, &views[i].down}) {
                const uint64_t nb = static_cast<uint64_t>(w->n_rows) * w->row_bytes;
                copy_to_host(back.back().as<uint8_t>() + at, w->data, nb, compute, "expert read-back");
                at += nb;
            }
        }
        filler->compute_done(compute.get());
        cache.release(step.layer);
        compute.synchronize("expert read-back");  // the test's own wait, outside any decode loop
        std::vector<std::string> out;
        for (const PinnedBuffer& b : back) out.emplace_back(b.as<const char>(), b.size());
        run.bytes.push_back(std::move(out));
        for (const auto& [il, e] : step.prefetch_after) cache.prefetch(il, e);
        cache.drain();
    }
    run.stats = cache.stats();
    return run;
}

}  // namespace sharpi::cuda
