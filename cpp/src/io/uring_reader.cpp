// UringReader: the fast expert reader, io_uring + O_DIRECT into (when possible) registered buffers.
//
// Owns: two descriptors of the model file (O_DIRECT for aligned reads; a plain one for the rare
// resumption of a short read that stopped at an unaligned position, which O_DIRECT cannot express
// and which only happens at end of file), one io_uring, an eventfd used to wake the ring's thread,
// the registration of the caller's arena, and one I/O thread.
//
// Threads: the decode thread queues requests in a ReadQueue (reader_common.h) under mutex_ and
// takes completions from it in reap(). Only the I/O thread touches the ring after construction: it
// turns queued requests into SQEs (chunks of at most chunk_bytes, at most queue_depth in flight,
// demand first), blocks in io_uring_submit_and_wait, and handles CQEs: short reads are re-submitted
// for the remainder, retryable errors (EAGAIN, EINTR, ECANCELED) are retried a few times, the rest
// finish the chunk. Keeping every submission on that one thread means the reads belong to a thread
// whose lifetime the reader controls (io_uring cancels requests of exiting threads) and their
// completion work never interrupts the decode thread's compute. The decode thread wakes the I/O
// thread by writing the eventfd, which has a (multishot) poll armed in the ring; it writes only
// when the I/O thread is asleep and no wake is pending, so wakes cost one syscall and at most one CQE.
//
// Registered buffers: the arena is registered in pieces of at most 1 GiB (the kernel's limit per
// buffer); a chunk lying inside one piece is read with IORING_OP_READ_FIXED, any other with
// IORING_OP_READ. If registration fails (RLIMIT_MEMLOCK, file-backed arena memory) every read is a
// plain one; describe() says which. Registration pins the arena's pages for the reader's lifetime.
//
// Must never: free or unregister memory the kernel may still write to. The destructor drops queued
// requests, lets the I/O thread run until every chunk in flight has its CQE, and only then joins
// it, unregisters the arena and tears the ring down.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "io/reader_common.h"
#include "sharpi/errors.h"

#if SHARPI_WITH_URING
#include <liburing.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/uio.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>
#endif

namespace sharpi::io {

#if SHARPI_WITH_URING

namespace {

constexpr uint64_t kWakeData = ~uint64_t{0};       // user_data of the eventfd poll
constexpr uint64_t kProbeData = ~uint64_t{0} - 1;  // user_data of the construction-time probe read
constexpr uint64_t kMaxRegisteredPiece = uint64_t{1} << 30;
constexpr int kMaxRetries = 8;

class UringReader final : public QueuedReader {
  public:
    UringReader(const std::string& path, const ResolvedOptions& options)
        : QueuedReader(path, options.chunk_bytes, options.queue_depth),
          path_(path),
          depth_(options.queue_depth) {}

    ~UringReader() override {
        if (io_thread_.joinable()) {
            {
                std::lock_guard<std::mutex> lock(mutex_);
                stopping_ = true;
                queue_.drop_queued();
                wake_sent_ = true;
            }
            kick();
            io_thread_.join();
        }
        if (registered_) io_uring_unregister_buffers(&ring_);
        if (ring_ready_) io_uring_queue_exit(&ring_);
        if (wake_fd_ >= 0) ::close(wake_fd_);
        if (fd_direct_ >= 0) ::close(fd_direct_);
        if (fd_buffered_ >= 0) ::close(fd_buffered_);
    }

    // Opens the file and sets up the ring. Returns false with *why when io_uring or O_DIRECT is not
    // usable here (the caller may fall back to pread); throws IoError when the file cannot be opened.
    bool init(uint8_t* arena, uint64_t arena_bytes, bool refuse_o_direct, std::string* why) {
        fd_buffered_ = open_or_throw(path_, 0);
        if (refuse_o_direct) {
            *why = "O_DIRECT refused (test knob refuse_o_direct)";
            return false;
        }
        fd_direct_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
        if (fd_direct_ < 0) {
            *why = std::string("O_DIRECT refused by the filesystem: ") + std::strerror(errno);
            return false;
        }
        const unsigned entries = static_cast<unsigned>(depth_) + 8;  // + wake poll, probe, slack
        int ret = io_uring_queue_init(entries, &ring_, IORING_SETUP_COOP_TASKRUN);
        if (ret == -EINVAL) ret = io_uring_queue_init(entries, &ring_, 0);  // kernel before 5.19
        if (ret < 0) {
            *why = std::string("io_uring_setup refused: ") + std::strerror(-ret);
            return false;
        }
        ring_ready_ = true;
        if (!probe_direct_read(why)) return false;

        wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (wake_fd_ < 0) throw IoError("[io] " + path_ + ": eventfd: " + std::strerror(errno));
        register_arena(arena, arena_bytes);
        slots_.resize(static_cast<size_t>(depth_));
        for (int i = depth_ - 1; i >= 0; --i) free_slots_.push_back(i);
        io_thread_ = std::thread([this] { io_loop(); });
        return true;
    }

    const char* name() const override { return "io_uring"; }

    std::string describe() const override {
        std::lock_guard<std::mutex> lock(mutex_);
        std::string s = "io_uring: O_DIRECT, ";
        s += use_fixed_ ? "registered buffers (" + std::to_string(arena_bytes_ >> 20) + " MiB arena in " +
                              std::to_string(n_pieces_) + (n_pieces_ == 1 ? " piece)" : " pieces)")
                        : "plain buffers (" + register_note_ + ")";
        s += ", depth " + std::to_string(depth_) + ", chunk " + std::to_string(queue_.chunk_bytes() / 1024) +
             " KiB";
        if (queue_.fault().armed()) s += ", EIO injected at " + hex(queue_.fault().offset());
        return s;
    }

  private:
    // One chunk being read: where it is and how far the kernel has got.
    struct InFlight {
        Chunk chunk;
        uint64_t pos = 0;  // next file byte to read; chunk.begin <= pos < chunk.end while in flight
        int retries = 0;
        bool fixed = false;  // the SQE in flight is a READ_FIXED
    };

    // Reads the first block through O_DIRECT on this (constructing) thread before the I/O thread
    // exists: some filesystems accept O_DIRECT at open and refuse it at read time, and a kernel
    // without IORING_OP_READ refuses the opcode; both mean "use pread instead".
    bool probe_direct_read(std::string* why) {
        void* block = std::aligned_alloc(kAlignment, kAlignment);
        if (block == nullptr) throw IoError("[io] " + path_ + ": out of memory");
        io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
        io_uring_prep_read(sqe, fd_direct_, block, static_cast<unsigned>(kAlignment), 0);
        io_uring_sqe_set_data64(sqe, kProbeData);
        int ret = io_uring_submit(&ring_);
        io_uring_cqe* cqe = nullptr;
        if (ret >= 0) {
            do {
                ret = io_uring_wait_cqe(&ring_, &cqe);
            } while (ret == -EINTR);
        }
        int res = ret;
        if (ret == 0) {
            res = cqe->res;
            io_uring_cqe_seen(&ring_, cqe);
        }
        std::free(block);
        if (res < 0) {
            *why = std::string("O_DIRECT read through io_uring refused: ") + std::strerror(-res);
            return false;
        }
        return true;
    }

    void register_arena(uint8_t* arena, uint64_t arena_bytes) {
        if (arena == nullptr || arena_bytes == 0) {
            register_note_ = "no arena given";
            return;
        }
        std::vector<iovec> pieces;
        for (uint64_t done = 0; done < arena_bytes; done += kMaxRegisteredPiece) {
            pieces.push_back(
                {arena + done, static_cast<size_t>(std::min(kMaxRegisteredPiece, arena_bytes - done))});
        }
        const int ret =
            io_uring_register_buffers(&ring_, pieces.data(), static_cast<unsigned>(pieces.size()));
        if (ret < 0) {
            register_note_ = std::string("registration failed: ") + std::strerror(-ret);
            return;
        }
        registered_ = true;
        use_fixed_ = true;
        arena_ = arena;
        arena_bytes_ = arena_bytes;
        n_pieces_ = pieces.size();
    }

    // Registered piece holding all of [dst, dst + len), or -1 (then the read is a plain one).
    int registered_piece(const uint8_t* dst, uint64_t len) const {
        if (!use_fixed_ || dst < arena_ || dst + len > arena_ + arena_bytes_) return -1;
        const uint64_t first = static_cast<uint64_t>(dst - arena_) / kMaxRegisteredPiece;
        const uint64_t last = static_cast<uint64_t>(dst + len - 1 - arena_) / kMaxRegisteredPiece;
        return first == last ? static_cast<int>(first) : -1;
    }

    // Under mutex_: true when the I/O thread sleeps in the ring and no wake is on its way.
    bool kick_needed_locked() override {
        if (!io_sleeping_ || wake_sent_) return false;
        wake_sent_ = true;
        return true;
    }

    void kick() override {
        const uint64_t one = 1;
        // Fails only when the counter is saturated, in which case a wake is pending anyway.
        [[maybe_unused]] const ssize_t n = ::write(wake_fd_, &one, sizeof(one));
    }

    // I/O thread only, from here on.
    io_uring_sqe* get_sqe() {
        io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
        while (sqe == nullptr) {  // the ring is sized so this does not happen; be safe anyway
            io_uring_submit(&ring_);
            sqe = io_uring_get_sqe(&ring_);
        }
        return sqe;
    }

    void arm_wake() {
        io_uring_sqe* sqe = get_sqe();
        if (wake_multishot_) {
            io_uring_prep_poll_multishot(sqe, wake_fd_, POLLIN);
        } else {
            io_uring_prep_poll_add(sqe, wake_fd_, POLLIN);
        }
        io_uring_sqe_set_data64(sqe, kWakeData);
    }

    void prep_read(int slot) {
        InFlight& f = slots_[static_cast<size_t>(slot)];
        uint8_t* dst = f.chunk.dst + (f.pos - f.chunk.begin);
        const uint64_t len = f.chunk.end - f.pos;
        // chunk.end is aligned, so an aligned position means an aligned length too.
        const int fd = f.pos % kAlignment == 0 ? fd_direct_ : fd_buffered_;
        io_uring_sqe* sqe = get_sqe();
        const int piece = registered_piece(dst, len);
        f.fixed = piece >= 0;
        if (piece >= 0) {
            io_uring_prep_read_fixed(sqe, fd, dst, static_cast<unsigned>(len), f.pos, piece);
        } else {
            io_uring_prep_read(sqe, fd, dst, static_cast<unsigned>(len), f.pos);
        }
        io_uring_sqe_set_data64(sqe, static_cast<uint64_t>(slot));
    }

    void finish_slot(int slot, int err, uint64_t reached) {
        queue_.finish_chunk(slots_[static_cast<size_t>(slot)].chunk, err, reached);
        free_slots_.push_back(slot);
    }

    void start_chunks() {
        while (!free_slots_.empty()) {
            Chunk chunk;
            if (!queue_.next_chunk(&chunk)) return;
            const int slot = free_slots_.back();
            free_slots_.pop_back();
            slots_[static_cast<size_t>(slot)] = InFlight{chunk, chunk.begin, 0};
            prep_read(slot);
        }
    }

    void handle_cqe(const io_uring_cqe* cqe) {
        const uint64_t data = io_uring_cqe_get_data64(cqe);
        if (data == kWakeData) {
            uint64_t count;
            [[maybe_unused]] const ssize_t n = ::read(wake_fd_, &count, sizeof(count));  // EAGAIN is fine
            wake_sent_ = false;
            if (!(cqe->flags & IORING_CQE_F_MORE)) {
                if (cqe->res == -EINVAL) wake_multishot_ = false;  // kernel before 5.13
                arm_wake();
            }
            return;
        }
        const int slot = static_cast<int>(data);
        InFlight& f = slots_[static_cast<size_t>(slot)];
        const int res = cqe->res;
        if (res < 0 && f.fixed && (res == -EFAULT || res == -EINVAL || res == -EOPNOTSUPP)) {
            // The kernel would not read into the registered buffer (a file or filesystem that does
            // not take fixed buffers): plain reads from now on, this chunk included.
            use_fixed_ = false;
            register_note_ = std::string("READ_FIXED refused: ") + std::strerror(-res);
            prep_read(slot);
        } else if (res < 0) {
            if ((res == -EAGAIN || res == -EINTR || res == -ECANCELED) && f.retries < kMaxRetries) {
                ++f.retries;
                prep_read(slot);
            } else {
                finish_slot(slot, -res, f.pos);
            }
        } else if (res == 0) {
            finish_slot(slot, 0, f.pos);  // end of file
        } else {
            f.pos += static_cast<uint64_t>(res);
            f.retries = 0;
            if (f.pos >= f.chunk.end) {
                finish_slot(slot, 0, f.chunk.end);
            } else {
                prep_read(slot);  // short read: the rest of the chunk
            }
        }
    }

    void io_loop() {
        std::unique_lock<std::mutex> lock(mutex_);
        arm_wake();
        for (;;) {
            start_chunks();
            if (queue_.completions_ready() > 0) done_cv_.notify_all();
            if (stopping_ && queue_.in_flight() == 0) return;
            io_sleeping_ = true;
            lock.unlock();
            int ret = io_uring_submit_and_wait(&ring_, 1);
            if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY) {
                // Not expected from a healthy ring. Reads already submitted still complete and are
                // handled below; pause so that a ring in a persistent error state cannot spin a core.
                ::usleep(1000);
            }
            lock.lock();
            io_sleeping_ = false;
            unsigned head;
            unsigned seen = 0;
            io_uring_cqe* cqe;
            io_uring_for_each_cqe(&ring_, head, cqe) {
                handle_cqe(cqe);
                ++seen;
            }
            io_uring_cq_advance(&ring_, seen);
        }
    }

    const std::string path_;
    const int depth_;
    int fd_direct_ = -1;
    int fd_buffered_ = -1;
    int wake_fd_ = -1;
    io_uring ring_{};
    bool ring_ready_ = false;
    bool wake_multishot_ = true;  // I/O thread only
    bool registered_ = false;     // set by init(), then constant: the destructor unregisters
    const uint8_t* arena_ = nullptr;
    uint64_t arena_bytes_ = 0;
    size_t n_pieces_ = 0;
    bool use_fixed_ = false;     // guarded by mutex_: READ_FIXED for buffers inside the arena
    std::string register_note_;  // guarded by mutex_: why reads are plain ones

    std::vector<InFlight> slots_;  // guarded by mutex_ (I/O thread)
    std::vector<int> free_slots_;  // guarded by mutex_ (I/O thread)
    bool stopping_ = false;        // guarded by mutex_
    bool io_sleeping_ = false;     // guarded by mutex_: I/O thread is (about to be) in the ring
    bool wake_sent_ = false;       // guarded by mutex_: an eventfd write is not yet consumed
    std::thread io_thread_;
};

}  // namespace

std::unique_ptr<ExpertReader> open_uring_reader(const std::string& path, uint8_t* arena, uint64_t arena_bytes,
                                                const ReaderOptions& options, std::string* why) {
    auto reader = std::make_unique<UringReader>(path, resolve_options(options));
    if (!reader->init(arena, arena_bytes, options.refuse_o_direct, why)) return nullptr;
    return reader;
}

#else  // !SHARPI_WITH_URING

std::unique_ptr<ExpertReader> open_uring_reader(const std::string& path, uint8_t*, uint64_t,
                                                const ReaderOptions& options, std::string* why) {
    resolve_options(options);         // same argument checks as the real reader
    ::close(open_or_throw(path, 0));  // a missing file is an IoError in every build
    *why = "io_uring support not compiled (liburing was not found at build time)";
    return nullptr;
}

#endif

}  // namespace sharpi::io
