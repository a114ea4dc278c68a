// UringReader: the fast expert reader, io_uring + O_DIRECT into (when possible) registered buffers.
//
// Owns: two descriptors of each model file (one per shard of a split GGUF; O_DIRECT for aligned
// reads; a plain one for the rare resumption of a short read that stopped at an unaligned position,
// which O_DIRECT cannot express and which only happens at end of file), one io_uring (UringRing,
// uring_ring.h: raw system calls, no liburing) with all descriptors registered as fixed files when
// the kernel allows, an eventfd
// used to wake the ring's thread, the registration of the caller's arena, and one I/O thread.
//
// Threads: the decode thread queues requests in a ReadQueue (reader_common.h) under mutex_ and
// takes completions from it in reap(). Only the I/O thread touches the ring after construction: it
// turns queued requests into SQEs (chunks of at most chunk_bytes, at most queue_depth in flight,
// demand first), blocks in io_uring_enter (submit + wait for one CQE), and handles CQEs: short
// reads are re-submitted for the remainder, retryable errors (EAGAIN, EINTR, ECANCELED) are retried
// a few times, the rest finish the chunk. Keeping every submission on that one thread means the
// reads belong to a thread whose lifetime the reader controls (io_uring cancels requests of exiting
// threads) and their completion work never interrupts the decode thread's compute. The decode
// thread wakes the I/O thread by writing the eventfd, which has a (multishot) poll armed in the
// ring; it writes only when the I/O thread is asleep and no wake is pending, so wakes cost one
// syscall and at most one CQE.
//
// Ring setup: IORING_SETUP_COOP_TASKRUN (5.19+; without it on older kernels): completion work runs
// when the I/O thread enters the kernel, which it does to wait anyway, instead of interrupting it.
// Entries: queue_depth + 8 (the wake poll, the probe, slack); the CQ is twice that, and every CQE
// is consumed before the next submission, so it cannot overflow.
//
// Registered buffers: the arena is registered in pieces of at most 1 GiB (the kernel's limit per
// buffer); a chunk lying inside one piece is read with IORING_OP_READ_FIXED, any other with
// IORING_OP_READ. If registration fails (RLIMIT_MEMLOCK, file-backed arena memory) every read is a
// plain one; describe() says which. Registration pins the arena's pages for the reader's lifetime.
//
// Falling back: construction fails softly (nullptr and a reason, so "auto" uses pread and says why)
// when io_uring_setup is refused (ENOSYS: no io_uring in this kernel or a seccomp filter; EPERM:
// kernel.io_uring_disabled or seccomp; EINVAL), when the rings cannot be mapped, when the file
// refuses O_DIRECT at open, or when a probe read of its first block through the ring fails (a
// filesystem that takes O_DIRECT at open but not at read time; a kernel before 5.6 without
// IORING_OP_READ). Test hook: SHARPI_FAULT_URING_SETUP=<errno name or number>, read at
// construction, makes io_uring_setup act as if the kernel had refused it with that error.
//
// Test hook for the completion path: SHARPI_FAULT_URING_RES=<what>@<offset>[x<count>], read at
// construction. Completions are read from a shared ring with no call an LD_PRELOAD shim could
// intercept, so the I/O thread rewrites the `res` of the CQE of a read whose range covers <offset>
// after the kernel has done the read: <what> is an errno name (EIO, EAGAIN, ECANCELED, EINTR,
// EFAULT, EINVAL, EOPNOTSUPP: res = -errno) or `short` (res = the bytes before <offset>, or half
// of what was read when the read starts at it: the remainder is then resumed, unaligned, through
// the buffered descriptor). <count> completions are rewritten (default 1; `x*` = every one).
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
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/uio.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "io/uring_ring.h"
#endif

namespace sharpi::io {

#if SHARPI_WITH_URING

namespace {

constexpr uint64_t kWakeData = ~uint64_t{0};       // user_data of the eventfd poll
constexpr uint64_t kProbeData = ~uint64_t{0} - 1;  // user_data of the construction-time probe read
constexpr uint64_t kMaxRegisteredPiece = uint64_t{1} << 30;
// The two descriptors of file f are fixed files 2f + kDirectFile and 2f + kBufferedFile.
constexpr int kDirectFile = 0;    // fds_direct_[f]
constexpr int kBufferedFile = 1;  // fds_buffered_[f]

// SHARPI_FAULT_URING_SETUP: 0 when unset, else the errno io_uring_setup is to "fail" with.
int setup_fault_from_env() {
    const char* v = std::getenv("SHARPI_FAULT_URING_SETUP");
    if (v == nullptr || *v == '\0') return 0;
    static const struct {
        const char* name;
        int err;
    } kNames[] = {
        {"EPERM", EPERM}, {"ENOSYS", ENOSYS}, {"EINVAL", EINVAL}, {"ENOMEM", ENOMEM}, {"EACCES", EACCES}};
    for (const auto& n : kNames) {
        if (std::strcmp(v, n.name) == 0) return n.err;
    }
    char* end = nullptr;
    const long err = std::strtol(v, &end, 10);
    if (end == v || *end != '\0' || err <= 0 || err > 4095) {
        throw InvalidArgument(std::string("SHARPI_FAULT_URING_SETUP: not an errno name or number: '") + v +
                              "'");
    }
    return static_cast<int>(err);
}

// SHARPI_FAULT_URING_RES, parsed (see the header comment). Inactive when count == 0.
struct CqeFault {
    int err = 0;  // errno to report; 0 = a short read
    uint64_t offset = 0;
    int count = 0;  // completions still to rewrite; -1 = all
};

CqeFault cqe_fault_from_env() {
    CqeFault f;
    const char* v = std::getenv("SHARPI_FAULT_URING_RES");
    if (v == nullptr || *v == '\0') return f;
    const std::string spec(v);
    auto bad = [&]() {
        return InvalidArgument(
            "SHARPI_FAULT_URING_RES: expected <errno name|short>@<offset>[x<count>|x*], got '" + spec + "'");
    };
    const size_t at = spec.find('@');
    if (at == std::string::npos) throw bad();
    const std::string what = spec.substr(0, at);
    static const struct {
        const char* name;
        int err;
    } kNames[] = {{"short", 0},     {"EIO", EIO},       {"EAGAIN", EAGAIN}, {"ECANCELED", ECANCELED},
                  {"EINTR", EINTR}, {"EFAULT", EFAULT}, {"EINVAL", EINVAL}, {"EOPNOTSUPP", EOPNOTSUPP}};
    bool known = false;
    for (const auto& n : kNames) {
        if (what == n.name) {
            f.err = n.err;
            known = true;
        }
    }
    if (!known) throw bad();
    const std::string rest = spec.substr(at + 1);
    const size_t x = rest.find('x', 2);  // after a possible "0x"
    const std::string offset = rest.substr(0, x);
    char* end = nullptr;
    errno = 0;
    f.offset = std::strtoull(offset.c_str(), &end, 0);
    if (offset.empty() || errno != 0 || *end != '\0' || offset[0] == '-') throw bad();
    f.count = 1;
    if (x != std::string::npos) {
        const std::string count = rest.substr(x + 1);
        if (count == "*") {
            f.count = -1;
        } else {
            f.count = static_cast<int>(std::strtol(count.c_str(), &end, 10));
            if (count.empty() || *end != '\0' || f.count <= 0) throw bad();
        }
    }
    return f;
}

class UringReader final : public QueuedReader {
  public:
    UringReader(const std::vector<std::string>& paths, const ResolvedOptions& options)
        : QueuedReader(paths, options.chunk_bytes, options.queue_depth),
          paths_(paths),
          path_(paths[0]),
          depth_(options.queue_depth),
          cqe_fault_(cqe_fault_from_env()) {}

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
        if (registered_) ring_.unregister_buffers();
        ring_.close();
        if (wake_fd_ >= 0) ::close(wake_fd_);
        for (int fd : fds_direct_) ::close(fd);
        for (int fd : fds_buffered_) ::close(fd);
    }

    // Opens the files and sets up the ring. Returns false with *why when io_uring or O_DIRECT is not
    // usable here (the caller may fall back to pread); throws IoError when a file cannot be opened.
    bool init(uint8_t* arena, uint64_t arena_bytes, bool refuse_o_direct, std::string* why) {
        for (const std::string& path : paths_) fds_buffered_.push_back(open_or_throw(path, 0));
        if (refuse_o_direct) {
            *why = "O_DIRECT refused (test knob refuse_o_direct)";
            return false;
        }
        for (const std::string& path : paths_) {
            const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
            if (fd < 0) {
                *why = std::string("O_DIRECT refused by the filesystem: ") + std::strerror(errno);
                return false;
            }
            fds_direct_.push_back(fd);
        }
        const unsigned entries = static_cast<unsigned>(depth_) + 8;  // + wake poll, probe, slack
        const char* step = "io_uring_setup";
        const int fault = setup_fault_from_env();
        auto setup = [&](unsigned flags) { return fault != 0 ? -fault : ring_.init(entries, flags, &step); };
        int ret = setup(IORING_SETUP_COOP_TASKRUN);
        if (ret == -EINVAL && std::strcmp(step, "io_uring_setup") == 0) ret = setup(0);  // kernel before 5.19
        if (ret < 0) {
            *why = std::string(step) + ": " + std::strerror(-ret);
            return false;
        }
        // Fixed files save a file-table lookup per read; without them the descriptors are used as is.
        std::vector<int> fds;
        for (size_t f = 0; f < paths_.size(); ++f) {
            fds.push_back(fds_direct_[f]);
            fds.push_back(fds_buffered_[f]);
        }
        fixed_files_ = ring_.register_files(fds.data(), static_cast<unsigned>(fds.size())) == 0;
        if (!probe_direct_read(why)) return false;

        wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (wake_fd_ < 0) throw IoError("[io] " + path_ + ": eventfd: " + std::strerror(errno));
        register_arena(arena, arena_bytes);
        slots_.resize(static_cast<size_t>(depth_));
        for (int i = depth_ - 1; i >= 0; --i) free_slots_.push_back(i);
        io_thread_ = std::thread([this] { io_loop(); });
        priority_note_ = raise_io_thread_priority(io_thread_);
        return true;
    }

    const char* name() const override { return "io_uring"; }

    std::string describe() const override {
        std::lock_guard<std::mutex> lock(mutex_);
        std::string s = "io_uring: O_DIRECT, ";
        s += use_fixed_ ? "registered buffers (" + std::to_string(arena_bytes_ >> 20) + " MiB arena in " +
                              std::to_string(n_pieces_) + (n_pieces_ == 1 ? " piece)" : " pieces)")
                        : "plain buffers (" + register_note_ + ")";
        if (fixed_files_) s += ", registered files";
        s += ", depth " + std::to_string(depth_) + ", chunk " + std::to_string(queue_.chunk_bytes() / 1024) +
             " KiB, I/O thread " + priority_note_;
        if (queue_.fault().armed()) s += ", EIO injected at " + hex(queue_.fault().offset());
        if (cqe_faults_fired_ > 0)
            s +=
                ", " + std::to_string(cqe_faults_fired_) + " completions rewritten by SHARPI_FAULT_URING_RES";
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
        prep_rw(ring_.get_sqe(), IORING_OP_READ, 0, kDirectFile, block, kAlignment, 0, kProbeData);
        int res = ring_.submit_and_wait(1);
        while (res == -EINTR) res = ring_.submit_and_wait(1);
        const bool submitted = res > 0;
        if (!submitted && res == 0) res = -EAGAIN;  // not taken by the kernel: nothing was probed
        bool seen = false;
        if (submitted) {
            while (!seen) {
                ring_.for_each_cqe([&](const io_uring_cqe& cqe) {
                    if (cqe.user_data == kProbeData) {
                        res = cqe.res;
                        seen = true;
                    }
                });
                if (!seen) {
                    const int ret = ring_.submit_and_wait(1);
                    if (ret < 0 && ret != -EINTR) {
                        res = ret;
                        break;
                    }
                }
            }
        }
        // Without its CQE the read may still be in flight: then the block is left to the kernel
        // (4 KiB, once, on a ring that is failing anyway) rather than freed under it.
        if (seen || !submitted) std::free(block);
        if (res < 0) {
            *why = std::string("O_DIRECT read through io_uring refused: ") + std::strerror(-res);
            return false;
        }
        return true;
    }

    // Fills a read SQE of file number `file`: `kind` is kDirectFile or kBufferedFile (a fixed-file
    // index when the files are registered, else the descriptor behind it); buf_index >= 0 makes it
    // a READ_FIXED.
    void prep_rw(io_uring_sqe* sqe, uint8_t opcode, uint32_t file, int kind, void* dst, uint64_t len,
                 uint64_t pos, uint64_t user_data, int buf_index = -1) const {
        sqe->opcode = opcode;
        if (fixed_files_) {
            sqe->fd = static_cast<int>(2 * file) + kind;
            sqe->flags = IOSQE_FIXED_FILE;
        } else {
            sqe->fd = kind == kDirectFile ? fds_direct_[file] : fds_buffered_[file];
        }
        sqe->addr = reinterpret_cast<uint64_t>(dst);
        sqe->len = static_cast<uint32_t>(len);
        sqe->off = pos;
        if (buf_index >= 0) sqe->buf_index = static_cast<uint16_t>(buf_index);
        sqe->user_data = user_data;
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
        const int ret = ring_.register_buffers(pieces.data(), static_cast<unsigned>(pieces.size()));
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
        io_uring_sqe* sqe = ring_.get_sqe();
        while (sqe == nullptr) {  // the ring is sized so this does not happen; be safe anyway
            ring_.submit_and_wait(0);
            sqe = ring_.get_sqe();
        }
        return sqe;
    }

    void arm_wake() {
        io_uring_sqe* sqe = get_sqe();
        sqe->opcode = IORING_OP_POLL_ADD;
        sqe->fd = wake_fd_;
        // The 16-bit field: the kernel reads 32 bits with the halves swapped on big-endian, which
        // puts these 16 bits where it looks on both byte orders (liburing does the swap instead).
        sqe->poll_events = POLLIN;
        if (wake_multishot_) sqe->len = IORING_POLL_ADD_MULTI;
        sqe->user_data = kWakeData;
    }

    void prep_read(int slot) {
        InFlight& f = slots_[static_cast<size_t>(slot)];
        uint8_t* dst = f.chunk.dst + (f.pos - f.chunk.begin);
        const uint64_t len = f.chunk.end - f.pos;
        // chunk.end is aligned, so an aligned position means an aligned length too.
        const int kind = f.pos % kAlignment == 0 ? kDirectFile : kBufferedFile;
        const int piece = registered_piece(dst, len);
        f.fixed = piece >= 0;
        prep_rw(get_sqe(), piece >= 0 ? IORING_OP_READ_FIXED : IORING_OP_READ, f.chunk.file, kind, dst, len,
                f.pos, static_cast<uint64_t>(slot), piece);
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
        const uint64_t data = cqe->user_data;
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
        const int res = inject_fault(f, cqe->res);
        if (res < 0 && f.fixed && (res == -EFAULT || res == -EINVAL || res == -EOPNOTSUPP)) {
            // The kernel would not read into the registered buffer (a file or filesystem that does
            // not take fixed buffers): plain reads from now on, this chunk included.
            use_fixed_ = false;
            register_note_ = std::string("READ_FIXED refused: ") + std::strerror(-res);
            prep_read(slot);
        } else if (res < 0) {
            if ((res == -EAGAIN || res == -EINTR || res == -ECANCELED) && f.retries < kMaxTransientRetries) {
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

    // SHARPI_FAULT_URING_RES: the res to act on for a completion of `f` whose real result is `res`.
    int inject_fault(const InFlight& f, int res) {
        CqeFault& q = cqe_fault_;
        if (q.count == 0 || res <= 0 || q.offset < f.pos || q.offset >= f.chunk.end) return res;
        const uint64_t before = q.offset - f.pos;
        if (q.err == 0 && before >= static_cast<uint64_t>(res)) return res;  // stopped short of it anyway
        if (q.count > 0) --q.count;
        ++cqe_faults_fired_;
        if (q.err != 0) return -q.err;
        return before > 0 ? static_cast<int>(before) : std::max(1, res / 2);
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
            const int ret = ring_.submit_and_wait(1);
            if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY) {
                // Not expected from a healthy ring. Reads already submitted still complete and are
                // handled below; pause so that a ring in a persistent error state cannot spin a core.
                ::usleep(1000);
            }
            lock.lock();
            io_sleeping_ = false;
            ring_.for_each_cqe([this](const io_uring_cqe& cqe) { handle_cqe(&cqe); });
        }
    }

    const std::vector<std::string> paths_;
    const std::string path_;  // paths_[0], for messages about the reader as a whole
    const int depth_;
    std::vector<int> fds_direct_;    // one per file (O_DIRECT)
    std::vector<int> fds_buffered_;  // one per file (plain, for unaligned resumptions)
    int wake_fd_ = -1;
    UringRing ring_;
    bool fixed_files_ = false;    // set by init(), then constant: both descriptors are fixed files
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
    CqeFault cqe_fault_;           // guarded by mutex_ (I/O thread; test hook)
    int cqe_faults_fired_ = 0;     // guarded by mutex_
    bool io_sleeping_ = false;     // guarded by mutex_: I/O thread is (about to be) in the ring
    bool wake_sent_ = false;       // guarded by mutex_: an eventfd write is not yet consumed
    std::thread io_thread_;
    std::string priority_note_;  // raise_io_thread_priority's outcome, set once at construction
};

}  // namespace

std::unique_ptr<ExpertReader> open_uring_reader(const std::vector<std::string>& paths, uint8_t* arena,
                                                uint64_t arena_bytes, const ReaderOptions& options,
                                                std::string* why) {
    auto reader = std::make_unique<UringReader>(paths, resolve_options(options));
    if (!reader->init(arena, arena_bytes, options.refuse_o_direct, why)) return nullptr;
    return reader;
}

#else  // !SHARPI_WITH_URING

std::unique_ptr<ExpertReader> open_uring_reader(const std::vector<std::string>& paths, uint8_t*, uint64_t,
                                                const ReaderOptions& options, std::string* why) {
    resolve_options(options);  // same argument checks as the real reader
    for (const std::string& path : paths)
        ::close(open_or_throw(path, 0));  // missing file: IoError in every build
    *why = "io_uring support not compiled (<linux/io_uring.h> missing or older than Linux 5.6 at build time)";
    return nullptr;
}

#endif

}  // namespace sharpi::io
