// Pieces shared by the two expert readers (uring_reader.cpp, pread_reader.cpp): the request queue
// with its priority rules, the decode-thread side (QueuedReader), the load accounting (LoadMeter:
// in-flight bytes, busy time, bandwidth), the fault-injection hook, option defaults and the error
// text.
//
// ReadQueue owns the bookkeeping of every request between submit() and reap(): which requests wait
// (two FIFO lists, demand before prefetch), how far each has been handed out as chunks, how many of
// its chunks are being read, its first error, and the finished completions. It does no I/O and
// takes no lock: each reader guards its ReadQueue with its own mutex, and its I/O threads take
// chunks from it, read them without the lock, and report the outcome back.
//
// Invariants:
// - A request is "started" once its first chunk has been handed out; only unstarted requests can be
//   cancelled. A request leaves the wait lists when its last chunk is handed out or it has failed.
// - A request completes (moves to the completion list) only when it has no chunk in flight, so a
//   completion is never delivered while an I/O thread or the kernel may still write into its buffer.
// - Chunks are pieces of the aligned superset [align_down(offset), align_up(offset + length)), each
//   at most chunk_bytes long and 4 KiB-aligned at both ends; every chunk overlaps the requested
//   range, so an end of file inside a chunk before the requested end is an error.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "io/expert_reader.h"

namespace sharpi::io {

constexpr int kDefaultQueueDepth = 16;
constexpr int kDefaultPreadThreads = 2;
constexpr uint64_t kDefaultChunkBytes = 512 * 1024;
// Transient read errors (EAGAIN, EINTR, ECANCELED) are retried this many times in a row per chunk
// before they fail the request: a device that keeps saying "try again" is treated as failing.
constexpr int kMaxTransientRetries = 8;

std::string hex(uint64_t v);

// "[io] <path>: read of [0x<offset>, 0x<offset + length>) failed: <reason>".
std::string read_error_text(const std::string& path, uint64_t offset, uint64_t length,
                            const std::string& reason);

// ReaderOptions with the defaults filled in and the values checked (InvalidArgument when negative).
struct ResolvedOptions {
    int queue_depth = kDefaultQueueDepth;
    int pread_threads = kDefaultPreadThreads;
    uint64_t chunk_bytes = kDefaultChunkBytes;
};
ResolvedOptions resolve_options(const ReaderOptions& options);

// SHARPI_FAULT_EIO_AT, read once at reader construction: a read whose requested range covers the
// offset completes with EIO instead of touching the file. Decimal or 0x-hex; anything else throws
// InvalidArgument naming the variable.
//
// SHARPI_FAULT_PREFETCH_DELAY_US (tests only, pread reader only): each chunk of a prefetch-priority
// read completes that many microseconds late, so tests can make a prefetch outlive the demand reads
// issued after it deterministically (the race between prefetch, drop and a later demand).
// SHARPI_FAULT_READ_DELAY_US (tests only, pread reader only): every chunk completes that many
// microseconds late, a slow or stalled device for the read timeout (SHARPI_READ_TIMEOUT_MS).
class FaultInjection {
  public:
    static FaultInjection from_env();
    bool hits(uint64_t begin, uint64_t end) const { return armed_ && begin <= offset_ && offset_ < end; }
    bool armed() const { return armed_; }
    uint64_t offset() const { return offset_; }
    uint64_t prefetch_delay_us() const { return prefetch_delay_us_; }
    uint64_t read_delay_us() const { return read_delay_us_; }

  private:
    bool armed_ = false;
    uint64_t offset_ = 0;
    uint64_t prefetch_delay_us_ = 0;
    uint64_t read_delay_us_ = 0;
};

struct QueuedRead;

// One piece of a request for an I/O thread: read bytes [begin, end) of file number `file` into dst.
struct Chunk {
    QueuedRead* read = nullptr;
    uint32_t file = 0;
    uint64_t begin = 0;
    uint64_t end = 0;
    uint8_t* dst = nullptr;
};

class ReadQueue {
  public:
    // depth: chunks that may be in flight at once (io_uring SQEs, or pread worker threads).
    // paths: the reader's files (error messages name the request's file; add() checks the index).
    ReadQueue(std::vector<std::string> paths, uint64_t chunk_bytes, int depth, FaultInjection fault);
    ~ReadQueue();
    ReadQueue(const ReadQueue&) = delete;
    ReadQueue& operator=(const ReadQueue&) = delete;

    // Validates and queues the request; throws InvalidArgument (null or unaligned buffer, zero
    // length, range overflowing 64 bits, tag already outstanding).
    void add(const ReadRequest& request);
    bool cancel(uint64_t tag);   // true when the request had not started and is now forgotten
    void promote(uint64_t tag);  // queued prefetch -> back of the demand list; otherwise no-op
    void set_plugged(bool plugged) { plugged_ = plugged; }
    bool plugged() const { return plugged_; }

    // Hands out the next chunk allowed to start now: none while plugged or at the depth limit; a
    // prefetch chunk only while no demand is queued and fewer than max(1, depth / 4) chunks are in
    // flight. Chunks in flight cannot be preempted, so this bounds what a demand read arriving later
    // waits behind (4 x 512 KiB with io_uring's defaults, which already reach the disk's sequential
    // bandwidth here) and keeps slots free for it. A chunk that the fault hook hits is failed here
    // and never handed out.
    bool next_chunk(Chunk* out);
    // The I/O thread's report for a handed-out chunk: err = errno (0 when no error); `reached` =
    // the file position where reading stopped (chunk.end when complete; less means end of file).
    void finish_chunk(const Chunk& chunk, int err, uint64_t reached);

    size_t take_completions(std::vector<ReadCompletion>& out);
    size_t completions_ready() const { return done_.size(); }
    size_t outstanding() const { return live_.size() + done_.size(); }
    int in_flight() const { return in_flight_; }
    int depth() const { return depth_; }
    uint64_t chunk_bytes() const { return chunk_bytes_; }
    const std::vector<std::string>& paths() const { return paths_; }
    const FaultInjection& fault() const { return fault_; }
    // The test delay that applies to this chunk (0 unless its read has prefetch priority and the hook
    // is armed). Call with the reader's lock held.
    uint64_t test_delay_us(const Chunk& chunk) const;

    // Shutdown: forgets every unstarted request (no completion) and stops handing out chunks of
    // started ones; chunks already in flight still have to be finished.
    void drop_queued();

  private:
    void unlink(QueuedRead* r);
    void complete_if_done(QueuedRead* r);

    std::vector<std::string> paths_;
    uint64_t chunk_bytes_;
    int depth_;
    int prefetch_limit_;  // prefetch chunks start only while in_flight_ < prefetch_limit_ (see next_chunk)
    FaultInjection fault_;
    bool plugged_ = false;
    int in_flight_ = 0;
    std::unordered_map<uint64_t, std::unique_ptr<QueuedRead>> live_;  // submitted, not completed
    std::list<QueuedRead*> demand_;
    std::list<QueuedRead*> prefetch_;
    std::vector<ReadCompletion> done_;  // completed, not yet reaped
};

// Load accounting of one reader (ExpertReader::inflight_bytes / busy_ms / bytes_per_ms): bytes of
// requests between submit and reap (or cancel), and the time that was non-zero. Decode thread only
// (it is updated by submit, cancel and reap), so it takes no lock.
class LoadMeter {
  public:
    void submitted(uint64_t tag, uint64_t bytes);
    void finished(uint64_t tag, bool completed);  // reaped (completed = ok) or cancelled (false)
    uint64_t inflight_bytes() const { return inflight_bytes_; }
    double busy_ms() const;
    double bytes_per_ms() const;

  private:
    using Clock = std::chrono::steady_clock;
    std::unordered_map<uint64_t, uint64_t> bytes_of_;  // tag -> requested bytes
    uint64_t inflight_bytes_ = 0;
    uint64_t completed_bytes_ = 0;
    double busy_ms_ = 0.0;  // closed busy intervals
    Clock::time_point busy_since_;
};

// The decode-thread side both readers share: requests live in a ReadQueue under mutex_, completions
// are handed out by reap(), and after any change that may let a chunk start the I/O side is kicked.
// A subclass says how: kick_needed_locked() (under mutex_; may record that a kick is on its way)
// and kick() (without the lock). Its I/O side finishes chunks through queue_ and notifies done_cv_.
class QueuedReader : public ExpertReader {
  public:
    void submit(const ReadRequest& request) override;
    bool cancel(uint64_t tag) override;
    void promote(uint64_t tag) override;
    void plug() override;
    void unplug() override;
    size_t reap(std::vector<ReadCompletion>& out, bool wait) override;
    size_t reap_for(std::vector<ReadCompletion>& out, double timeout_ms) override;
    size_t outstanding() const override;
    uint64_t inflight_bytes() const override { return load_.inflight_bytes(); }
    double busy_ms() const override { return load_.busy_ms(); }
    double bytes_per_ms() const override { return load_.bytes_per_ms(); }

  protected:
    QueuedReader(std::vector<std::string> paths, uint64_t chunk_bytes, int depth);
    virtual bool kick_needed_locked() = 0;
    virtual void kick() = 0;
    // reap() and reap_for(): wait until a completion arrives, nothing is outstanding, or `deadline`
    // passes (nullptr: no deadline).
    size_t reap_until(std::vector<ReadCompletion>& out, bool wait,
                      const std::chrono::steady_clock::time_point* deadline);

    mutable std::mutex mutex_;
    std::condition_variable done_cv_;  // reap(): a completion arrived
    ReadQueue queue_;                  // guarded by mutex_
    LoadMeter load_;                   // decode thread only
};

// Constructors used by reader_factory.cpp. open_uring_reader returns nullptr and sets *why when
// io_uring or O_DIRECT cannot be used for these files (not compiled, io_uring_setup refused, O_DIRECT
// refused by the filesystem); both throw IoError when a file cannot be opened at all.
// refuse_o_direct (tests only) acts as if the filesystem refused O_DIRECT.
std::unique_ptr<ExpertReader> open_pread_reader(const std::vector<std::string>& paths,
                                                const ReaderOptions& options, const std::string& note);
std::unique_ptr<ExpertReader> open_uring_reader(const std::vector<std::string>& paths, uint8_t* arena,
                                                uint64_t arena_bytes, const ReaderOptions& options,
                                                std::string* why);

// Asks for real-time scheduling of an I/O thread (the io_uring ring's thread, each pread worker),
// called by the thread that created it. Such a thread only starts chunks and hands back
// completions, but it must run as soon as a chunk completes: while the compute threads hold every
// core, a completed chunk is neither handed back nor followed by the next, and the disk idles under
// a decode that waits for it (docs/streaming_io.md, "The I/O thread's priority"). So it gets
// SCHED_FIFO one level above the caller's when the caller is SCHED_FIFO or SCHED_RR (`chrt`), else
// level 1, which puts it ahead of every normal thread. It blocks in the kernel between chunks, so
// it cannot hold a core. Without the privilege (not root, no CAP_SYS_NICE or RLIMIT_RTPRIO) the
// thread keeps its normal priority; SHARPI_IO_REALTIME=0 does not ask. Returns what happened, for
// describe(): "SCHED_FIFO <level>" or "normal priority (<why>)".
std::string raise_io_thread_priority(std::thread& thread);

// Opens `path` read-only (plus extra_flags); throws IoError "[io] <path>: cannot open: <strerror>".
int open_or_throw(const std::string& path, int extra_flags);

}  // namespace sharpi::io
