// UringRing: one io_uring, set up and driven through the raw system calls (io_uring_setup,
// io_uring_enter, io_uring_register via syscall(2)) and <linux/io_uring.h>, the header every
// toolchain's kernel headers carry: no liburing, so no system package is needed to build it.
//
// Owns: the ring's file descriptor and its three shared mappings (SQ ring, CQ ring, SQE array; the
// two rings share one mapping when the kernel reports IORING_FEAT_SINGLE_MMAP, 5.4+). Registered
// buffers and files belong to the ring and go away with it.
//
// Threading: not thread-safe. The SQ side (get_sqe, submit_and_wait) and the CQ side
// (for_each_cqe) must be used by one thread at a time; UringReader hands the ring to its I/O thread
// after construction, and thread creation orders everything before it.
//
// Memory ordering, the contract the kernel documents (and liburing implements):
// - SQ: we fill an SQE, then publish it by storing the new tail with release semantics, so the
//   kernel never sees a tail that covers an SQE still being written. The kernel's head is read with
//   acquire semantics before an SQE slot is reused.
// - CQ: the kernel's tail is read with acquire semantics before the CQEs below it are read; our new
//   head is stored with release semantics after they have been read, so the kernel never overwrites
//   a CQE we are still reading.
// No SQPOLL: the kernel consumes SQEs only inside io_uring_enter, on the calling thread.
//
// Must never: be torn down (destructor) while requests are in flight into memory that is about to
// be freed; that is the owner's job (UringReader waits for every CQE first).
#pragma once

#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>

namespace sharpi::io {

// Flags added to the header after the oldest kernel headers this builds against (5.6, the first
// with IORING_OP_READ). Their values are kernel ABI and never change; a kernel that does not know
// one refuses it (EINVAL) and the reader falls back as it would with liburing.
#ifndef IORING_SETUP_COOP_TASKRUN
#define IORING_SETUP_COOP_TASKRUN (1U << 8)  // 5.19
#endif
#ifndef IORING_POLL_ADD_MULTI
#define IORING_POLL_ADD_MULTI (1U << 0)  // 5.13
#endif
#ifndef IORING_CQE_F_MORE
#define IORING_CQE_F_MORE (1U << 1)  // 5.13
#endif

class UringRing {
  public:
    UringRing() = default;
    ~UringRing() { close(); }
    UringRing(const UringRing&) = delete;
    UringRing& operator=(const UringRing&) = delete;

    // io_uring_setup with `entries` SQEs (the kernel rounds up to a power of two; the CQ gets twice
    // as many) and `flags`, then maps the rings. Returns 0, or -errno with *step naming the call
    // that failed ("io_uring_setup", "mmap of the io_uring rings"); the ring is then closed again.
    int init(unsigned entries, unsigned flags, const char** step) {
        io_uring_params p;
        std::memset(&p, 0, sizeof(p));
        p.flags = flags;
        const long fd = ::syscall(__NR_io_uring_setup, entries, &p);
        if (fd < 0) {
            *step = "io_uring_setup";
            return -errno;
        }
        fd_ = static_cast<int>(fd);
        features_ = p.features;
        sq_entries_ = p.sq_entries;

        sq_map_bytes_ = p.sq_off.array + p.sq_entries * sizeof(uint32_t);
        cq_map_bytes_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
        const bool single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
        if (single) sq_map_bytes_ = cq_map_bytes_ = std::max(sq_map_bytes_, cq_map_bytes_);
        sq_map_ = map(sq_map_bytes_, IORING_OFF_SQ_RING);
        if (sq_map_ != nullptr) cq_map_ = single ? sq_map_ : map(cq_map_bytes_, IORING_OFF_CQ_RING);
        sqes_bytes_ = p.sq_entries * sizeof(io_uring_sqe);
        if (cq_map_ != nullptr) sqes_ = static_cast<io_uring_sqe*>(map(sqes_bytes_, IORING_OFF_SQES));
        if (sqes_ == nullptr) {
            const int err = errno;
            close();
            *step = "mmap of the io_uring rings";
            return -err;
        }

        char* sq = static_cast<char*>(sq_map_);
        sq_khead_ = reinterpret_cast<unsigned*>(sq + p.sq_off.head);
        sq_ktail_ = reinterpret_cast<unsigned*>(sq + p.sq_off.tail);
        sq_kflags_ = reinterpret_cast<unsigned*>(sq + p.sq_off.flags);
        sq_mask_ = *reinterpret_cast<unsigned*>(sq + p.sq_off.ring_mask);
        unsigned* array = reinterpret_cast<unsigned*>(sq + p.sq_off.array);
        for (unsigned i = 0; i < sq_entries_; ++i) array[i] = i;  // SQ slot i always holds SQE i
        sqe_tail_ = *sq_ktail_;

        char* cq = static_cast<char*>(cq_map_);
        cq_khead_ = reinterpret_cast<unsigned*>(cq + p.cq_off.head);
        cq_ktail_ = reinterpret_cast<unsigned*>(cq + p.cq_off.tail);
        cq_mask_ = *reinterpret_cast<unsigned*>(cq + p.cq_off.ring_mask);
        cqes_ = reinterpret_cast<io_uring_cqe*>(cq + p.cq_off.cqes);
        return 0;
    }

    bool ready() const { return fd_ >= 0; }
    unsigned features() const { return features_; }
    unsigned sq_entries() const { return sq_entries_; }

    // A zeroed SQE to fill, or nullptr when every SQ slot holds an SQE the kernel has not consumed
    // yet (submit first). It goes to the kernel with the next submit_and_wait().
    io_uring_sqe* get_sqe() {
        const unsigned head = __atomic_load_n(sq_khead_, __ATOMIC_ACQUIRE);
        if (sqe_tail_ - head >= sq_entries_) return nullptr;
        io_uring_sqe* sqe = &sqes_[sqe_tail_ & sq_mask_];
        ++sqe_tail_;
        std::memset(sqe, 0, sizeof(*sqe));
        return sqe;
    }

    // Publishes the SQEs filled since the last call and enters the kernel: submits them and, with
    // wait_nr > 0, blocks until at least wait_nr CQEs are available (also running the completion
    // work that IORING_SETUP_COOP_TASKRUN defers to this call). Returns the number of SQEs the
    // kernel consumed, or -errno (EINTR, EAGAIN, EBUSY: try again after reaping).
    int submit_and_wait(unsigned wait_nr) {
        __atomic_store_n(sq_ktail_, sqe_tail_, __ATOMIC_RELEASE);
        const unsigned to_submit = sqe_tail_ - __atomic_load_n(sq_khead_, __ATOMIC_ACQUIRE);
        unsigned flags = 0;
        // GETEVENTS also when not waiting if the kernel holds overflowed CQEs it wants to flush.
        if (wait_nr > 0 || (__atomic_load_n(sq_kflags_, __ATOMIC_RELAXED) & IORING_SQ_CQ_OVERFLOW)) {
            flags |= IORING_ENTER_GETEVENTS;
        }
        const long ret = ::syscall(__NR_io_uring_enter, fd_, to_submit, wait_nr, flags, nullptr, 0);
        return ret < 0 ? -errno : static_cast<int>(ret);
    }

    // Calls f(const io_uring_cqe&) for every CQE available now, oldest first, then hands their
    // slots back to the kernel. f may get and fill SQEs (a separate ring). Returns the count.
    template <typename F>
    unsigned for_each_cqe(F&& f) {
        unsigned head = *cq_khead_;  // only this side writes the CQ head
        const unsigned tail = __atomic_load_n(cq_ktail_, __ATOMIC_ACQUIRE);
        const unsigned n = tail - head;
        for (; head != tail; ++head) f(cqes_[head & cq_mask_]);
        __atomic_store_n(cq_khead_, head, __ATOMIC_RELEASE);
        return n;
    }

    // io_uring_register(2): 0 or -errno.
    int register_buffers(const iovec* iov, unsigned n) { return reg(IORING_REGISTER_BUFFERS, iov, n); }
    int unregister_buffers() { return reg(IORING_UNREGISTER_BUFFERS, nullptr, 0); }
    int register_files(const int* fds, unsigned n) { return reg(IORING_REGISTER_FILES, fds, n); }

    void close() {
        if (sqes_ != nullptr) ::munmap(sqes_, sqes_bytes_);
        if (cq_map_ != nullptr && cq_map_ != sq_map_) ::munmap(cq_map_, cq_map_bytes_);
        if (sq_map_ != nullptr) ::munmap(sq_map_, sq_map_bytes_);
        if (fd_ >= 0) ::close(fd_);
        sqes_ = nullptr;
        cq_map_ = sq_map_ = nullptr;
        fd_ = -1;
    }

  private:
    void* map(size_t bytes, uint64_t offset) {
        void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_,
                         static_cast<off_t>(offset));
        return p == MAP_FAILED ? nullptr : p;
    }

    int reg(unsigned opcode, const void* arg, unsigned n) {
        const long ret = ::syscall(__NR_io_uring_register, fd_, opcode, arg, n);
        return ret < 0 ? -errno : 0;
    }

    int fd_ = -1;
    unsigned features_ = 0;
    unsigned sq_entries_ = 0;
    void* sq_map_ = nullptr;
    void* cq_map_ = nullptr;
    io_uring_sqe* sqes_ = nullptr;
    size_t sq_map_bytes_ = 0;
    size_t cq_map_bytes_ = 0;
    size_t sqes_bytes_ = 0;

    unsigned* sq_khead_ = nullptr;   // written by the kernel
    unsigned* sq_ktail_ = nullptr;   // written by us (release)
    unsigned* sq_kflags_ = nullptr;  // written by the kernel
    unsigned sq_mask_ = 0;
    unsigned sqe_tail_ = 0;  // next SQE to hand out; published to *sq_ktail_ by submit_and_wait

    unsigned* cq_khead_ = nullptr;  // written by us (release)
    unsigned* cq_ktail_ = nullptr;  // written by the kernel
    unsigned cq_mask_ = 0;
    io_uring_cqe* cqes_ = nullptr;
};

}  // namespace sharpi::io
