// A fixed pool of worker threads for data-parallel loops on the decode thread's behalf. Used by the
// engine (which owns one per session) and by the backends' kernels, so it lives under neither.
//
// Owns n_threads - 1 workers; the calling thread is worker 0, so ThreadPool(1) runs inline.
// parallel_for cuts [0, n) into a fixed grid of contiguous chunks (a function of n and n_threads
// only) and the threads claim chunks from an atomic counter, so a thread that another process
// preempts holds up one chunk, not a whole share (docs/design.md §9: these 2-core machines are shared).
// Which thread runs a chunk depends on timing, but every chunk computes its elements with the
// same code in the same order, so results never do: bodies must not let their output depend on
// thread_index (use it only to pick scratch). Workers spin briefly after a job (with pause
// instructions, reading the clock rarely) and then block on a condition variable: a pool that only
// spins collapses when another process holds a core.
//
// Not reentrant: parallel_for must not be called from inside a parallel_for body, and only one
// thread may call parallel_for at a time.
//
// Cost accounting (SHARPI_POOL_STATS=1, read when a pool is built; off by default, and off costs one
// predictable branch per region and per chunk): every pool adds to process-wide counters what its
// parallel regions cost beyond their work, so a benchmark can set it against TPOT
// (benchmarks/bench_threadpool.py). See ThreadPoolStats.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace sharpi {

// Process-wide sums over every parallel region run with SHARPI_POOL_STATS=1 (nanoseconds, steady
// clock). A region starts when parallel_for publishes its job (dispatch) and ends when it returns.
struct ThreadPoolStats {
    uint64_t regions = 0;         // parallel_for calls handed to the workers
    uint64_t inline_regions = 0;  // calls run inline (one thread, n == 1, below kMinParallelBytes)
    uint64_t thread_slots = 0;    // sum over regions of n_threads
    uint64_t region_ns = 0;       // caller's wall time inside regions, dispatch to return
    uint64_t busy_ns = 0;         // time any thread spent inside bodies during regions
    uint64_t wake_ns = 0;         // sum over workers that joined a region of dispatch -> joining it
    uint64_t workers_joined = 0;  // workers that joined a region (claimed a chunk or found none left)
    uint64_t workers_late = 0;    // of those, workers that found every chunk already claimed
    uint64_t workers_missed = 0;  // workers woken for a region that had already returned
    uint64_t worker_sleeps = 0;   // times a worker stopped spinning and blocked on the condition variable
    uint64_t caller_wait_ns = 0;  // caller: its last chunk done -> return (the barrier, critical path)
};
// Lost wall time of all regions = region_ns - busy_ns / n_threads (the ideal is the work split
// evenly over the threads, no wake-up, no barrier): wake-up latency, the barrier and imbalance.
ThreadPoolStats thread_pool_stats();
void reset_thread_pool_stats();

class ThreadPool {
  public:
    explicit ThreadPool(int n_threads);
    ~ThreadPool();
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;

    int n_threads() const { return n_threads_; }

    // Calls body(begin, end, thread_index) on each chunk of [0, n); returns when all are done.
    // An exception thrown by a body is rethrown here (the first one) after all chunks finish.
    using Body = std::function<void(int64_t begin, int64_t end, int thread_index)>;
    void parallel_for(int64_t n, const Body& body);
    // The same over exactly min(n, n_chunks) chunks, for callers whose elements are already
    // work items of balanced size (a grouped GEMM's (expert, row block) items): one item per chunk
    // lets a thread that finishes early take the next item instead of idling at the barrier.
    void parallel_for(int64_t n, const Body& body, int64_t n_chunks);

    // parallel_for for a loop whose whole work reads about `bytes` (weights, or activations for
    // loops without weights): below kMinParallelBytes it runs inline as body(0, n, 0), since
    // waking the workers and meeting them at the barrier would cost more than the loop itself (on
    // a shared machine a descheduled worker holding a claimed chunk stalls the caller for a time
    // slice). Bodies already give the same results however [0, n) is cut, so this changes no bit.
    static constexpr int64_t kMinParallelBytes = 128 * 1024;
    // n_chunks > 0: as the three-argument parallel_for.
    void parallel_for_bytes(int64_t n, int64_t bytes, const Body& body, int64_t n_chunks = 0) {
        if (bytes < kMinParallelBytes) {
            if (stats_) note_inline_region();
            if (n > 0) body(0, n, 0);
        } else if (n_chunks > 0) {
            parallel_for(n, body, n_chunks);
        } else {
            parallel_for(n, body);
        }
    }

    // Chunk i of n_chunks over [0, n) (contiguous, sizes differing by at most one).
    static void chunk(int64_t n, int64_t i, int64_t n_chunks, int64_t* begin, int64_t* end);

  private:
    // One parallel_for call. Lives on the caller's stack; workers reach it through job_ and the
    // caller returns only when every chunk is done and no worker still holds a pointer to it.
    struct Job {
        const Body* body = nullptr;
        int64_t n = 0;
        int64_t n_chunks = 0;
        std::atomic<int64_t> next{0};  // next chunk to claim
        std::atomic<int64_t> done{0};  // chunks finished (thrown or not)
        uint64_t dispatch_ns = 0;      // with stats_: when the job was published
    };

    void worker_main(int ith);
    // Runs chunks until none is left; returns whether this thread ran any.
    bool run_job(Job& job, int ith);
    static void note_inline_region();

    int n_threads_;
    const bool stats_;  // SHARPI_POOL_STATS set when the pool was built
    std::vector<std::thread> workers_;
    std::mutex mutex_;
    std::condition_variable wake_;
    std::atomic<Job*> job_{nullptr};
    std::atomic<int> active_{0};  // workers between picking up job_ and leaving it
    std::atomic<uint64_t> generation_{0};
    std::atomic<bool> stop_{false};
    std::exception_ptr error_;
    std::mutex error_mutex_;
};

// Online cores of this machine (at least 1).
int hardware_threads();

}  // namespace sharpi

// The CPU kernels were written against cpu::ThreadPool; the names stay valid there.
namespace sharpi::cpu {
using sharpi::hardware_threads;
using sharpi::reset_thread_pool_stats;
using sharpi::thread_pool_stats;
using sharpi::ThreadPool;
using sharpi::ThreadPoolStats;
}  // namespace sharpi::cpu
