// PreadReader: the expert reader that works everywhere (no liburing, no io_uring, filesystems that
// refuse O_DIRECT) and the reference the tests hold UringReader to.
//
// Owns one plain read-only file descriptor per file and a small pool of worker threads (2 by default). The
// decode thread queues requests in a ReadQueue (reader_common.h) under mutex_; each worker takes one
// chunk (at most chunk_bytes of the aligned superset) at a time, in priority order, reads it with
// pread() outside the lock, resuming short reads until the chunk is complete or the file ends, and
// reports back. Taking chunks rather than whole requests is what lets a demand read overtake a long
// prefetch: it waits for at most one chunk per worker.
//
// Workers block on a condition variable when there is nothing to start; nothing spins. The
// destructor drops queued requests and joins the workers, each of which finishes the chunk it is
// reading first, so no worker writes into a caller's buffer after the destructor returns.
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "io/reader_common.h"

namespace sharpi::io {

namespace {

class PreadReader final : public QueuedReader {
  public:
    // fds: one per path, in order; owned by the reader once the constructor returns (the caller
    // closes them when it throws).
    PreadReader(const std::vector<std::string>& paths, const std::vector<int>& fds,
                const ResolvedOptions& options, const std::string& note)
        : QueuedReader(paths, options.chunk_bytes, options.pread_threads),
          fds_(fds),
          n_threads_(options.pread_threads),
          note_(note) {
        workers_.reserve(static_cast<size_t>(options.pread_threads));
        try {
            for (int i = 0; i < options.pread_threads; ++i) {
                workers_.emplace_back([this] { worker_loop(); });
                priority_note_ = raise_io_thread_priority(workers_.back());  // the same for every worker
            }
        } catch (...) {
            stop_workers();  // the fds stay with the caller, which closes them on this exception
            throw;
        }
    }

    ~PreadReader() override {
        stop_workers();
        close_fds();
    }

    const char* name() const override { return "pread"; }

    std::string describe() const override {
        std::string s = "pread: " + std::to_string(n_threads_) + " threads, ";
        if (fds_.size() > 1) s += std::to_string(fds_.size()) + " files, ";
        s += "chunk " + std::to_string(queue_.chunk_bytes() / 1024) + " KiB, I/O threads " + priority_note_;
        if (queue_.fault().armed()) s += ", EIO injected at " + hex(queue_.fault().offset());
        if (!note_.empty()) s += " (" + note_ + ")";
        return s;
    }

  private:
    bool kick_needed_locked() override { return true; }
    void kick() override { work_cv_.notify_all(); }

    void close_fds() {
        for (int fd : fds_) ::close(fd);
        fds_.clear();
    }

    void stop_workers() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stopping_ = true;
            queue_.drop_queued();
        }
        work_cv_.notify_all();
        for (std::thread& t : workers_) t.join();
        workers_.clear();
    }

    void worker_loop() {
        std::unique_lock<std::mutex> lock(mutex_);
        for (;;) {
            Chunk chunk;
            const bool got = queue_.next_chunk(&chunk);
            // next_chunk may have completed requests on its own (fault hook), so look either way.
            if (queue_.completions_ready() > 0) done_cv_.notify_all();
            if (got) {
                const uint64_t delay_us = queue_.test_delay_us(chunk);
                lock.unlock();
                int err = 0;
                const uint64_t reached = read_chunk(chunk, &err);
                if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
                lock.lock();
                queue_.finish_chunk(chunk, err, reached);
                continue;
            }
            // After drop_queued() nothing is startable; chunks other workers hold are theirs to finish.
            if (stopping_) return;
            work_cv_.wait(lock);
        }
    }

    // Reads [chunk.begin, chunk.end) into chunk.dst, resuming short reads and retrying transient
    // errors (EINTR always; EAGAIN, which a file opened without O_NONBLOCK should not return but
    // network and FUSE filesystems do, up to kMaxTransientRetries times in a row, backing off).
    // Returns the position reached (chunk.end unless the file ended first); sets *err on a read error.
    uint64_t read_chunk(const Chunk& chunk, int* err) const {
        uint64_t pos = chunk.begin;
        int retries = 0;
        while (pos < chunk.end) {
            const ssize_t n = ::pread(fds_[chunk.file], chunk.dst + (pos - chunk.begin), chunk.end - pos,
                                      static_cast<off_t>(pos));
            if (n < 0) {
                if (errno == EINTR) continue;
                if (errno == EAGAIN && retries < kMaxTransientRetries) {
                    ++retries;
                    std::this_thread::sleep_for(std::chrono::microseconds(100 << retries));
                    continue;
                }
                *err = errno;
                return pos;
            }
            if (n == 0) break;  // end of file
            pos += static_cast<uint64_t>(n);
            retries = 0;
        }
        return pos;
    }

    std::vector<int> fds_;  // one per file, in the order of the paths; constant while workers run
    const int n_threads_;
    const std::string note_;           // why "auto" fell back to this reader, if it did
    std::string priority_note_;        // raise_io_thread_priority's outcome, set once at construction
    std::condition_variable work_cv_;  // workers: a chunk may be startable, or stopping
    bool stopping_ = false;            // guarded by mutex_
    std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<ExpertReader> open_pread_reader(const std::vector<std::string>& paths,
                                                const ReaderOptions& options, const std::string& note) {
    const ResolvedOptions resolved = resolve_options(options);
    std::vector<int> fds;
    try {
        for (const std::string& path : paths) fds.push_back(open_or_throw(path, 0));
        return std::make_unique<PreadReader>(paths, fds, resolved, note);
    } catch (...) {
        for (int fd : fds) ::close(fd);
        throw;
    }
}

}  // namespace sharpi::io
