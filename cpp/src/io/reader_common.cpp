// Request queue, fault hook and error text shared by both expert readers. See reader_common.h.
#include "io/reader_common.h"

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "sharpi/errors.h"

namespace sharpi::io {

// A request between submit() and completion. Owned by ReadQueue::live_.
struct QueuedRead {
    ReadRequest request;
    uint64_t span_begin = 0;  // align_down(offset)
    uint64_t span_end = 0;    // align_up(offset + length)
    uint64_t next_begin = 0;  // first byte of the span not yet handed out as a chunk
    int chunks_in_flight = 0;
    std::list<QueuedRead*>* list = nullptr;  // demand_ or prefetch_ while waiting, else nullptr
    std::list<QueuedRead*>::iterator list_pos;
    std::string error;  // first failure; empty while all is well
    bool started() const { return next_begin != span_begin; }
};

std::string hex(uint64_t v) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "0x%" PRIx64, v);
    return buf;
}

std::string read_error_text(const std::string& path, uint64_t offset, uint64_t length,
                            const std::string& reason) {
    return "[io] " + path + ": read of [" + hex(offset) + ", " + hex(offset + length) + ") failed: " + reason;
}

ResolvedOptions resolve_options(const ReaderOptions& options) {
    if (options.queue_depth < 0 || options.pread_threads < 0) {
        throw InvalidArgument(
            "[io] reader options: queue_depth and pread_threads must be >= 0 (0 = default)");
    }
    if (options.queue_depth > 4096 || options.pread_threads > 256) {
        throw InvalidArgument("[io] reader options: queue_depth must be <= 4096 and pread_threads <= 256");
    }
    if (options.chunk_bytes > (uint64_t{1} << 30)) {
        throw InvalidArgument("[io] reader options: chunk_bytes must be <= 1 GiB");
    }
    ResolvedOptions r;
    if (options.queue_depth > 0) r.queue_depth = options.queue_depth;
    if (options.pread_threads > 0) r.pread_threads = options.pread_threads;
    if (options.chunk_bytes > 0) r.chunk_bytes = ExpertReader::align_up(options.chunk_bytes);
    return r;
}

namespace {

// A test hook's delay in microseconds from the environment (0 when unset).
uint64_t delay_from_env(const char* name) {
    const char* delay = std::getenv(name);
    if (delay == nullptr || *delay == '\0') return 0;
    char* end = nullptr;
    const uint64_t us = std::strtoull(delay, &end, 10);
    if (end == delay || *end != '\0') {
        throw InvalidArgument(std::string(name) + ": not a number: '" + delay + "'");
    }
    return us;
}

}  // namespace

FaultInjection FaultInjection::from_env() {
    FaultInjection f;
    f.prefetch_delay_us_ = delay_from_env("SHARPI_FAULT_PREFETCH_DELAY_US");
    f.read_delay_us_ = delay_from_env("SHARPI_FAULT_READ_DELAY_US");
    const char* value = std::getenv("SHARPI_FAULT_EIO_AT");
    if (value == nullptr || *value == '\0') return f;
    errno = 0;
    char* end = nullptr;
    const unsigned long long parsed = std::strtoull(value, &end, 0);
    if (errno != 0 || end == value || *end != '\0' || value[0] == '-') {
        throw InvalidArgument(std::string("SHARPI_FAULT_EIO_AT: not a byte offset: '") + value + "'");
    }
    f.armed_ = true;
    f.offset_ = parsed;
    return f;
}

std::string raise_io_thread_priority(std::thread& thread) {
    const char* env = std::getenv("SHARPI_IO_REALTIME");
    if (env != nullptr && std::strcmp(env, "0") == 0) return "normal priority (SHARPI_IO_REALTIME=0)";
    int policy = SCHED_OTHER;
    sched_param own{};
    if (pthread_getschedparam(pthread_self(), &policy, &own) != 0) policy = SCHED_OTHER;
    sched_param want{};
    const bool real_time = policy == SCHED_FIFO || policy == SCHED_RR;
    want.sched_priority =
        real_time ? std::min(own.sched_priority + 1, sched_get_priority_max(SCHED_FIFO)) : 1;
    const int rc = pthread_setschedparam(thread.native_handle(), SCHED_FIFO, &want);
    if (rc != 0) return std::string("normal priority (SCHED_FIFO refused: ") + std::strerror(rc) + ")";
    return "SCHED_FIFO " + std::to_string(want.sched_priority);
}

int open_or_throw(const std::string& path, int extra_flags) {
    int fd;
    do {
        fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | extra_flags);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) throw IoError("[io] " + path + ": cannot open: " + std::strerror(errno));
    return fd;
}

ReadQueue::ReadQueue(std::vector<std::string> paths, uint64_t chunk_bytes, int depth, FaultInjection fault)
    : paths_(std::move(paths)),
      chunk_bytes_(chunk_bytes),
      depth_(depth),
      prefetch_limit_(std::max(1, depth / 4)),
      fault_(fault) {}

ReadQueue::~ReadQueue() = default;

uint64_t ReadQueue::test_delay_us(const Chunk& chunk) const {
    const uint64_t prefetch =
        chunk.read->request.priority == ReadPriority::prefetch ? fault_.prefetch_delay_us() : 0;
    return std::max(prefetch, fault_.read_delay_us());
}

void ReadQueue::add(const ReadRequest& request) {
    if (request.file >= paths_.size()) {
        throw InvalidArgument("[io] read request (tag " + std::to_string(request.tag) + "): file " +
                              std::to_string(request.file) + " out of range (the reader has " +
                              std::to_string(paths_.size()) + ")");
    }
    const std::string what =
        "[io] " + paths_[request.file] + ": read request (tag " + std::to_string(request.tag) + ")";
    if (request.buffer == nullptr) throw InvalidArgument(what + ": buffer is null");
    if (reinterpret_cast<uintptr_t>(request.buffer) % ExpertReader::kAlignment != 0) {
        throw InvalidArgument(what + ": buffer is not " + std::to_string(ExpertReader::kAlignment) +
                              "-byte aligned");
    }
    if (request.length == 0) throw InvalidArgument(what + ": length is 0");
    if (request.offset > std::numeric_limits<uint64_t>::max() - request.length - ExpertReader::kAlignment) {
        throw InvalidArgument(what + ": range [" + hex(request.offset) + ", +" + hex(request.length) +
                              ") overflows 64 bits");
    }
    if (request.priority != ReadPriority::demand && request.priority != ReadPriority::prefetch) {
        throw InvalidArgument(what + ": unknown priority");
    }
    bool duplicate = live_.count(request.tag) != 0;
    for (const ReadCompletion& c : done_) duplicate = duplicate || c.tag == request.tag;
    if (duplicate) throw InvalidArgument(what + ": tag is already outstanding");

    auto r = std::make_unique<QueuedRead>();
    r->request = request;
    r->span_begin = ExpertReader::align_down(request.offset);
    r->span_end = ExpertReader::align_up(request.offset + request.length);
    r->next_begin = r->span_begin;
    r->list = request.priority == ReadPriority::demand ? &demand_ : &prefetch_;
    r->list_pos = r->list->insert(r->list->end(), r.get());
    live_.emplace(request.tag, std::move(r));
}

void ReadQueue::unlink(QueuedRead* r) {
    if (r->list == nullptr) return;
    r->list->erase(r->list_pos);
    r->list = nullptr;
}

bool ReadQueue::cancel(uint64_t tag) {
    auto it = live_.find(tag);
    if (it == live_.end() || it->second->started()) return false;
    unlink(it->second.get());
    live_.erase(it);
    return true;
}

void ReadQueue::promote(uint64_t tag) {
    auto it = live_.find(tag);
    if (it == live_.end()) return;
    QueuedRead* r = it->second.get();
    if (r->list != &prefetch_) return;
    unlink(r);
    r->request.priority = ReadPriority::demand;
    r->list = &demand_;
    r->list_pos = demand_.insert(demand_.end(), r);
}

bool ReadQueue::next_chunk(Chunk* out) {
    while (!plugged_) {
        std::list<QueuedRead*>* from = nullptr;
        if (!demand_.empty() && in_flight_ < depth_) {
            from = &demand_;
        } else if (demand_.empty() && !prefetch_.empty() && in_flight_ < prefetch_limit_) {
            from = &prefetch_;
        } else {
            return false;
        }
        QueuedRead* r = from->front();
        Chunk c;
        c.read = r;
        c.file = r->request.file;
        c.begin = r->next_begin;
        c.end = std::min(r->span_end, c.begin + chunk_bytes_);
        c.dst = r->request.buffer + (c.begin - r->span_begin);
        r->next_begin = c.end;
        if (r->next_begin == r->span_end) unlink(r);
        ++r->chunks_in_flight;
        ++in_flight_;
        const uint64_t want_begin = std::max(c.begin, r->request.offset);
        const uint64_t want_end = std::min(c.end, r->request.offset + r->request.length);
        if (fault_.hits(want_begin, want_end)) {
            finish_chunk(c, EIO, c.begin);
            continue;
        }
        *out = c;
        return true;
    }
    return false;
}

void ReadQueue::finish_chunk(const Chunk& chunk, int err, uint64_t reached) {
    QueuedRead* r = chunk.read;
    --r->chunks_in_flight;
    --in_flight_;
    const uint64_t want_end = std::min(chunk.end, r->request.offset + r->request.length);
    if (r->error.empty()) {
        if (err != 0) {
            r->error =
                read_error_text(paths_[chunk.file], r->request.offset, r->request.length, std::strerror(err));
        } else if (reached < want_end) {
            r->error = read_error_text(paths_[chunk.file], r->request.offset, r->request.length,
                                       "end of file at " + hex(reached));
        }
    }
    if (!r->error.empty()) unlink(r);  // a failed request starts no more chunks
    complete_if_done(r);
}

void ReadQueue::complete_if_done(QueuedRead* r) {
    if (r->chunks_in_flight != 0 || r->list != nullptr) return;
    ReadCompletion c;
    c.tag = r->request.tag;
    c.ok = r->error.empty();
    c.error = r->error;
    live_.erase(r->request.tag);  // destroys *r
    done_.push_back(std::move(c));
}

size_t ReadQueue::take_completions(std::vector<ReadCompletion>& out) {
    const size_t n = done_.size();
    for (ReadCompletion& c : done_) out.push_back(std::move(c));
    done_.clear();
    return n;
}

void ReadQueue::drop_queued() {
    std::vector<uint64_t> forget;
    std::vector<QueuedRead*> cut_short;
    for (auto& [tag, r] : live_) {
        if (!r->started()) {
            forget.push_back(tag);
        } else if (r->list != nullptr) {
            cut_short.push_back(r.get());
        }
    }
    for (uint64_t tag : forget) {
        unlink(live_[tag].get());
        live_.erase(tag);
    }
    for (QueuedRead* r : cut_short) {
        unlink(r);
        if (r->error.empty()) r->error = "[io] " + paths_[r->request.file] + ": reader shut down";
        complete_if_done(r);
    }
}

// ---------------------------------------------------------------------------------------------
// QueuedReader

void LoadMeter::submitted(uint64_t tag, uint64_t bytes) {
    if (inflight_bytes_ == 0) busy_since_ = Clock::now();
    inflight_bytes_ += bytes;
    bytes_of_[tag] = bytes;
}

void LoadMeter::finished(uint64_t tag, bool completed) {
    auto it = bytes_of_.find(tag);
    if (it == bytes_of_.end()) return;
    const uint64_t bytes = it->second;
    bytes_of_.erase(it);
    inflight_bytes_ -= std::min(bytes, inflight_bytes_);
    if (completed) completed_bytes_ += bytes;
    if (inflight_bytes_ == 0)
        busy_ms_ += std::chrono::duration<double, std::milli>(Clock::now() - busy_since_).count();
}

double LoadMeter::busy_ms() const {
    double busy = busy_ms_;
    if (inflight_bytes_ > 0)
        busy += std::chrono::duration<double, std::milli>(Clock::now() - busy_since_).count();
    return busy;
}

double LoadMeter::bytes_per_ms() const {
    const double busy = busy_ms();
    return busy > 0.0 && completed_bytes_ > 0 ? static_cast<double>(completed_bytes_) / busy : 0.0;
}

QueuedReader::QueuedReader(std::vector<std::string> paths, uint64_t chunk_bytes, int depth)
    : queue_(std::move(paths), chunk_bytes, depth, FaultInjection::from_env()) {}

void QueuedReader::submit(const ReadRequest& request) {
    bool wake;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        queue_.add(request);
        wake = !queue_.plugged() && kick_needed_locked();
    }
    load_.submitted(request.tag, request.length);
    if (wake) kick();
}

bool QueuedReader::cancel(uint64_t tag) {
    bool cancelled;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        cancelled = queue_.cancel(tag);
    }
    if (cancelled) load_.finished(tag, /*completed=*/false);
    return cancelled;
}

void QueuedReader::promote(uint64_t tag) {
    bool wake;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        queue_.promote(tag);
        wake = !queue_.plugged() && kick_needed_locked();  // a prefetch held back by the limit may start
    }
    if (wake) kick();
}

void QueuedReader::plug() {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.set_plugged(true);
}

void QueuedReader::unplug() {
    bool wake;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        queue_.set_plugged(false);
        wake = kick_needed_locked();
    }
    if (wake) kick();
}

size_t QueuedReader::reap(std::vector<ReadCompletion>& out, bool wait) {
    return reap_until(out, wait, nullptr);
}

size_t QueuedReader::reap_for(std::vector<ReadCompletion>& out, double timeout_ms) {
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double, std::milli>(std::max(0.0, timeout_ms)));
    return reap_until(out, true, &deadline);
}

size_t QueuedReader::reap_until(std::vector<ReadCompletion>& out, bool wait,
                                const std::chrono::steady_clock::time_point* deadline) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (wait) {
        if (queue_.plugged()) {  // waiting on a plugged queue would never return
            queue_.set_plugged(false);
            if (kick_needed_locked()) {
                lock.unlock();
                kick();
                lock.lock();
            }
        }
        const auto done = [this] { return queue_.completions_ready() > 0 || queue_.outstanding() == 0; };
        if (deadline) {
            done_cv_.wait_until(lock, *deadline, done);
        } else {
            done_cv_.wait(lock, done);
        }
    }
    const size_t first = out.size();
    const size_t n = queue_.take_completions(out);
    lock.unlock();
    for (size_t i = first; i < out.size(); ++i) load_.finished(out[i].tag, out[i].ok);
    return n;
}

size_t QueuedReader::outstanding() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return queue_.outstanding();
}

}  // namespace sharpi::io
