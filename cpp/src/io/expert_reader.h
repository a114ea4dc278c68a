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
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace sharpi {

enum class ReadPriority : int { demand = 0, prefetch = 1 };

struct ReadRequest {
    uint64_t tag = 0;      // caller's id for this read, unique among outstanding requests
    uint64_t offset = 0;   // file offset of the first wanted byte
    uint64_t length = 0;   // wanted bytes
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
    virtual size_t outstanding() const = 0;  // queued + in flight

    static uint64_t align_down(uint64_t x) { return x & ~(kAlignment - 1); }
    static uint64_t align_up(uint64_t x) { return (x + kAlignment - 1) & ~(kAlignment - 1); }
    // Bytes a buffer must hold for a request of [offset, offset + length).
    static uint64_t aligned_span(uint64_t offset, uint64_t length) {
        return align_up(offset + length) - align_down(offset);
    }
};

// kind: "auto" (io_uring when it works on this file, else pread), "uring" (throws
// UnsupportedError when io_uring or O_DIRECT is unavailable), "pread".
// `arena`/`arena_bytes`: memory that will hold every buffer passed to submit (registered with
// io_uring when possible; may be nullptr). Throws IoError when the file cannot be opened.
std::unique_ptr<ExpertReader> make_expert_reader(const std::string& kind, const std::string& path, uint8_t* arena,
                                                 uint64_t arena_bytes);

// True when this build has io_uring support compiled in (liburing found at build time).
bool uring_compiled();

}  // namespace sharpi
