// A fixed pool of worker threads for data-parallel loops on the decode thread's behalf.
//
// Owns n_threads - 1 workers; the calling thread is worker 0, so ThreadPool(1) runs inline.
// parallel_for splits [0, n) into n_threads contiguous chunks, a fixed function of (n, n_threads),
// so each output element is always computed by the same code in the same order: results do not
// depend on timing. Workers spin briefly after a job and then block on a condition variable:
// a pool that only spins collapses when another process holds a core (DESIGN §9).
//
// Not reentrant: parallel_for must not be called from inside a parallel_for body, and only one
// thread may call parallel_for at a time.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace sharpi::cpu {

class ThreadPool {
public:
    explicit ThreadPool(int n_threads);
    ~ThreadPool();
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;

    int n_threads() const { return n_threads_; }

    // Calls body(begin, end, thread_index) on each non-empty chunk of [0, n); returns when all are done.
    // An exception thrown by a body is rethrown here (the first one) after all chunks finish.
    using Body = std::function<void(int64_t begin, int64_t end, int thread_index)>;
    void parallel_for(int64_t n, const Body& body);

    // Chunk [begin, end) of [0, n) that thread `ith` of `nth` takes; exposed for callers that size buffers.
    static void chunk(int64_t n, int ith, int nth, int64_t* begin, int64_t* end);

private:
    void worker_main(int ith);
    void run_chunk(int ith);

    int n_threads_;
    std::vector<std::thread> workers_;
    std::mutex mutex_;
    std::condition_variable wake_;
    const Body* body_ = nullptr;
    int64_t n_ = 0;
    std::atomic<uint64_t> generation_{0};
    std::atomic<int> pending_{0};
    std::atomic<bool> stop_{false};
    std::exception_ptr error_;
    std::mutex error_mutex_;
};

// Online cores of this machine (at least 1).
int hardware_threads();

}  // namespace sharpi::cpu
