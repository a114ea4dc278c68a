// Reads byte ranges of the model's files into caller-owned buffers, asynchronously, for the expert
// cache. A reader serves a list of files (the shards of a split GGUF; one entry for a one-file
// model) and a request names its file by index into that list; every file has its own descriptor(s). Two
// implementations with the same contract:
//   UringReader: io_uring + O_DIRECT, reads into registered buffers when possible (the fast path);
//   PreadReader: a small thread pool doing pread(), always built; the fallback when io_uring or
//                O_DIRECT is unavailable, and the reference the tests compare UringReader against.
// A reader owns its file descriptors, its I/O threads or ring, its request queue and its load
// accounting; it never owns the buffers it reads into and never interprets the bytes.
//
// Contract:
// - A request covers [offset, offset + length) of file number `file`. O_DIRECT needs 4 KiB-aligned offsets,
//   lengths and buffers, and expert ranges in GGUF are not aligned, so every reader reads the
//   aligned superset [align_down(offset), align_up(offset + length)) (clipped at end of file) into
//   `buffer` and the requested bytes start at buffer + (offset % kAlignment). `buffer` must be
//   kAlignment-aligned and hold aligned_span(offset, length) bytes. Both readers place identical
//   bytes there: the span inside the file holds the file's bytes; bytes of the span past the end
//   of the file are unspecified (O_DIRECT may transfer the whole last block).
// - Priorities: every queued demand request is started before any queued prefetch request.
//   promote(tag) raises a queued prefetch to demand; cancel(tag) drops a request that has not
//   started (returns false once it is in flight: it will complete normally). Cancelled requests
//   never produce a completion.
// - plug()/unplug(): while plugged, submitted requests are queued but none is started, so a batch
//   (a layer's misses plus its prefetches) is ordered by priority as a whole before the first read
//   goes out, as the block layer's plugging does. reap(wait = true) unplugs first (waiting on a
//   plugged queue would never return).
// - Short reads are resumed until the range is complete; a read that cannot complete (EIO, end of
//   file inside the requested range) completes with ok = false and an error naming the file and
//   the range: "[io] <path>: read of [0x<offset>, 0x<offset + length>) failed: <reason>", the
//   range being the requested one; <reason> is strerror(errno) or "end of file at 0x<pos>".
//   Nothing throws from the I/O path except submit() on invalid arguments.
// - outstanding() counts requests submitted and not yet returned by reap(): queued, in flight, or
//   finished but not reaped, so `while (r.outstanding()) r.reap(out, true);` drains everything.
// - Threading: submit/cancel/promote/plug/unplug/reap and the load accounting are called by one
//   thread (the decode thread that owns the cache). Completions are delivered only through reap().
// - Destruction drops queued requests (no completion) and waits for every read in flight: no kernel
//   or worker thread writes into a caller's buffer after the destructor returns.
// - Test hook: SHARPI_FAULT_EIO_AT=<byte offset> makes any read whose requested range [offset,
//   offset + length) covers that offset (in any of the reader's files) complete with EIO, in both
//   readers (not the aligned superset, so a test can fail one expert without touching its
//   neighbours in the same 4 KiB block). The variable is read once, when the reader is constructed
//   (decimal or 0x-hex; anything else is InvalidArgument), so setting it later does not affect an
//   existing reader.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace sharpi {

enum class ReadPriority : int { demand = 0, prefetch = 1 };

struct ReadRequest {
    uint64_t tag = 0;           // caller's id for this read, unique among outstanding requests
    uint32_t file = 0;          // index into the reader's files (InvalidArgument when out of range)
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
    // reap(out, true) that gives up after timeout_ms: returns 0 with nothing appended when no
    // request completed in time (a stalled device), so the caller can report it or look at a cancel
    // flag instead of blocking forever.
    virtual size_t reap_for(std::vector<ReadCompletion>& out, double timeout_ms) = 0;
    virtual size_t outstanding() const = 0;  // queued + in flight + finished but not yet reaped

    // Load accounting (decode thread, like submit/reap): requested bytes (not the aligned superset)
    // submitted and neither reaped nor cancelled; the time at least one request was outstanding,
    // since construction; and the measured bandwidth, completed bytes over that time (0 until a
    // read has completed). Completions are only observed at reap(), so busy time is an upper bound
    // and the bandwidth a lower bound. The prefetcher's timeliness test and io_busy_ms use these.
    virtual uint64_t inflight_bytes() const = 0;
    virtual double busy_ms() const = 0;
    virtual double bytes_per_ms() const = 0;

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

// The reader names a user may give (--reader, Session(reader=)), parsed in one place for every tier:
// the RAM tier's make_expert_reader and the VRAM tier's fill source (cuda/device_tier.cu) accept the
// same names with the same error. "uring" is an alias of "io_uring".
enum class ReaderKind { automatic, io_uring, pread, cufile };
// Throws InvalidArgument naming the accepted names for anything else.
ReaderKind parse_reader_kind(const std::string& name);

// kind: "auto" (io_uring when it works on this file, else pread), "uring" (throws
// UnsupportedError when io_uring or O_DIRECT is unavailable), "pread".
// `arena`/`arena_bytes`: memory that will hold every buffer passed to submit (registered with
// io_uring when possible; may be nullptr). Throws IoError when a file cannot be opened.
// `paths`: the files requests may name (ReadRequest::file); one path = a one-file model.
std::unique_ptr<ExpertReader> make_expert_reader(const std::string& kind,
                                                 const std::vector<std::string>& paths, uint8_t* arena,
                                                 uint64_t arena_bytes, const ReaderOptions& options);
std::unique_ptr<ExpertReader> make_expert_reader(const std::string& kind, const std::string& path,
                                                 uint8_t* arena, uint64_t arena_bytes);
// The same with tuning knobs (ReaderOptions{} gives the defaults).
std::unique_ptr<ExpertReader> make_expert_reader(const std::string& kind, const std::string& path,
                                                 uint8_t* arena, uint64_t arena_bytes,
                                                 const ReaderOptions& options);

// True when this build has io_uring support compiled in (every Linux build: raw system calls).
bool uring_compiled();

}  // namespace sharpi
