// Reads byte ranges of the model file into caller-owned buffers, asynchronously, for the expert
// cache. Two implementations with the same contract:
//   UringReader: io_uring + O_DIRECT, reads into registered buffers when possible (the fast path);
//   PreadReader: a small thread pool doing pread(), always built; the fallback when io_uring or
//                O_DIRECT is unavailable, and the reference the tests compare UringReader against.
//
// Contract:
// - A request covers [offset, offset + length) of the file. O_DIRECT needs 4 KiB-aligned offsets,
//   lengths and buffers, and expert ranges in GGUF are not aligned, so every reader reads the
//   aligned superset [align_down(offset), align_up(offset + length)) (clipped at end of file) into
//   `buffer` and the requested bytes start at buffer + (offset % kAlignment). `buffer` must be
//   kAlignment-aligned and hold aligned_span(offset, length) bytes. Both readers place identical
//   bytes there.
// - Priorities: every queued demand request is started before any queued prefetch request.
//   promote(tag) raises a queued prefetch to demand; cancel(tag) drops a request that has not
//   started (returns false once it is in flight: it will complete normally).
// - Short reads are resumed until the range is complete; a read that cannot complete (EIO, end of
//   file inside the requested range) completes with ok = false and an error naming the file and
//   the range. Nothing throws from the I/O path except submit() on invalid arguments.
// - Threading: submit/cancel/promote/reap are called by one thread (the decode thread that owns the
//   cache). Completions are delivered only through reap().
// - Test hook: SHARPI_FAULT_EIO_AT=<byte offset> makes any read whose range covers that offset
//   complete with EIO, in both readers (used by the fault-injection tests).
//
// Additions to the contract above (readers branch):
// - "Covers" in the fault hook means the requested range [offset, offset + length), not the aligned
//   superset, so a test can fail one expert without touching its neighbours in the same 4 KiB block.
//   The variable is read once, when the reader is constructed (decimal or 0x-hex; anything else is
//   InvalidArgument), so setting it later does not affect an existing reader.
// - Bytes of the aligned span past the end of the file are unspecified (O_DIRECT may transfer the
//   whole last block); bytes of the span inside the file are the file's, in both readers.
// - Error text: "[io] <path>: read of [0x<offset>, 0x<offset + length>) failed: <reason>", the
//   range being the requested one; <reason> is strerror(errno) or "end of file at 0x<pos>".
// - plug()/unplug(): while plugged, submitted requests are queued but none is started, so a batch
//   (a layer's misses plus its prefetches) is ordered by priority as a whole before the first read
//   goes out, as the block layer's plugging does. reap(wait = true) unplugs first (waiting on a
//   plugged queue would never return).
// - outstanding() counts requests submitted and not yet returned by reap(): queued, in flight, or
//   finished but not reaped, so `while (r.outstanding()) r.reap(out, true);` drains everything.
// - Cancelled requests never produce a completion.
// - Destruction drops queued requests (no completion) and waits for every read in flight: no kernel
//   or worker thread writes into a caller's buffer after the destructor returns.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace sharpi {

enum class ReadPriority : int { demand = 0, prefetch = 1 };

struct ReadRequest {
    uint64_t tag = 0;           // caller's id for this read, unique among outstanding requests
    uint64_t offset = 0;        // file offset of the first wanted byte
    uint64_t length = 0;        // wanted bytes
    uint8_t* buffer = nullptr;  // kAlignment-aligned, at least aligned_span(offset, length) bytes
    ReadPriority priority = ReadPriority::demand;
};

struct ReadCompletion {
    uint64_t tag = 0;
    bool ok = false;
    std::string error;  // empty when ok
};

class ExpertReader {
  public:
    static constexpr uint64_t kAlignment = 4096;

    virtual ~ExpertReader() = default;
    virtual const char* name() const = 0;  // "io_uring" or "pread"

    virtual void submit(const ReadRequest& request) = 0;
    virtual bool cancel(uint64_t tag) = 0;
    virtual void promote(uint64_t tag) = 0;
    // Appends finished requests to `out`; with wait = true blocks until at least one completes
    // (returns at once when nothing is outstanding). Returns the number appended.
    virtual size_t reap(std::vector<ReadCompletion>& out, bool wait) = 0;
    virtual size_t outstanding() const = 0;  // queued + in flight + finished but not yet reaped

    virtual void plug() = 0;    // hold every new request in the queue ...
    virtual void unplug() = 0;  // ... until this call, then start them in priority order
    // One line for logs and benchmarks: reader name, O_DIRECT, registered buffers, depth, chunk size.
    virtual std::string describe() const = 0;

    static uint64_t align_down(uint64_t x) { return x & ~(kAlignment - 1); }
    static uint64_t align_up(uint64_t x) { return (x + kAlignment - 1) & ~(kAlignment - 1); }
    // Bytes a buffer must hold for a request of [offset, offset + length).
    static uint64_t aligned_span(uint64_t offset, uint64_t length) {
        return align_up(offset + length) - align_down(offset);
    }
};

// Tuning knobs; 0 means the default. Tests use depth 1 / one worker to make completion order
// observable; the engine uses the defaults.
struct ReaderOptions {
    int queue_depth = 0;           // io_uring: chunks in flight at once (default 16)
    int pread_threads = 0;         // pread: worker threads (default 2)
    uint64_t chunk_bytes = 0;      // reads are split into chunks of this size (default 512 KiB;
                                   // rounded up to kAlignment) so a demand read waits for at most
                                   // one chunk of a prefetch, never for a whole long read
    bool refuse_o_direct = false;  // tests only: act as if the filesystem refused O_DIRECT
};

// kind: "auto" (io_uring when it works on this file, else pread), "uring" (throws
// UnsupportedError when io_uring or O_DIRECT is unavailable), "pread".
// `arena`/`arena_bytes`: memory that will hold every buffer passed to submit (registered with
// io_uring when possible; may be nullptr). Throws IoError when the file cannot be opened.
std::unique_ptr<ExpertReader> make_expert_reader(const std::string& kind, const std::string& path,
                                                 uint8_t* arena, uint64_t arena_bytes);
// The same with tuning knobs (ReaderOptions{} gives the defaults).
std::unique_ptr<ExpertReader> make_expert_reader(const std::string& kind, const std::string& path,
                                                 uint8_t* arena, uint64_t arena_bytes,
                                                 const ReaderOptions& options);

// True when this build has io_uring support compiled in (liburing found at build time).
bool uring_compiled();

}  // namespace sharpi
