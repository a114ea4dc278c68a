#include "cpu/threadpool.h"

#include <immintrin.h>

#include <algorithm>
#include <chrono>

#include "sharpi/errors.h"

namespace sharpi::cpu {

namespace {
// How long a worker spins on the generation counter before blocking. Short: a decode step issues
// parallel_for calls microseconds apart, but spinning longer than that steals a core from others.
constexpr auto kSpinTime = std::chrono::microseconds(200);
// Chunks per thread: enough that a preempted thread delays little work, few enough that claiming
// (one atomic increment) stays negligible.
constexpr int64_t kChunksPerThread = 4;

// Spins until done() or kSpinTime passed, reading the clock only every 64 pauses.
template <typename Done>
bool spin_until(Done done) {
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
        for (int i = 0; i < 64; ++i) {
            if (done()) return true;
            _mm_pause();
        }
        if (std::chrono::steady_clock::now() - start > kSpinTime) return done();
    }
}
}  // namespace

int hardware_threads() {
    unsigned n = std::thread::hardware_concurrency();
    return n == 0 ? 1 : static_cast<int>(n);
}

ThreadPool::ThreadPool(int n_threads) : n_threads_(n_threads) {
    if (n_threads < 1 || n_threads > 1024) {
        throw InvalidArgument("threads must be in [1, 1024], got " + std::to_string(n_threads));
    }
    workers_.reserve(static_cast<size_t>(n_threads - 1));
    for (int i = 1; i < n_threads; ++i) workers_.emplace_back([this, i] { worker_main(i); });
}

ThreadPool::~ThreadPool() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stop_.store(true);
        generation_.fetch_add(1);
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
}

void ThreadPool::chunk(int64_t n, int64_t i, int64_t n_chunks, int64_t* begin, int64_t* end) {
    const int64_t base = n / n_chunks, rem = n % n_chunks;
    *begin = i * base + (i < rem ? i : rem);
    *end = *begin + base + (i < rem ? 1 : 0);
}

void ThreadPool::run_job(Job& job, int ith) {
    for (;;) {
        const int64_t i = job.next.fetch_add(1, std::memory_order_relaxed);
        if (i >= job.n_chunks) return;
        int64_t begin, end;
        chunk(job.n, i, job.n_chunks, &begin, &end);
        try {
            (*job.body)(begin, end, ith);
        } catch (...) {
            std::lock_guard<std::mutex> lock(error_mutex_);
            if (!error_) error_ = std::current_exception();
        }
        job.done.fetch_add(1, std::memory_order_release);
    }
}

void ThreadPool::parallel_for(int64_t n, const Body& body) {
    parallel_for(n, body, n_threads_ * kChunksPerThread);
}

void ThreadPool::parallel_for(int64_t n, const Body& body, int64_t n_chunks) {
    if (n <= 0) return;
    if (n_threads_ == 1 || n == 1) {
        body(0, n, 0);
        return;
    }
    Job job;
    job.body = &body;
    job.n = n;
    job.n_chunks = std::min<int64_t>(n, std::max<int64_t>(1, n_chunks));
    error_ = nullptr;
    job_.store(&job);
    {
        std::lock_guard<std::mutex> lock(mutex_);
        generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    run_job(job, 0);
    // Every chunk is claimed; wait only for chunks still running on workers (a worker that was
    // never scheduled claimed nothing and is not waited for): spin briefly, then yield.
    auto finished = [&job] { return job.done.load(std::memory_order_acquire) == job.n_chunks; };
    while (!spin_until(finished)) std::this_thread::yield();
    // Unpublish the job, then wait out workers that picked up the pointer (they find no chunk left).
    job_.store(nullptr);
    while (active_.load() != 0) _mm_pause();
    if (error_) std::rethrow_exception(error_);
}

void ThreadPool::worker_main(int ith) {
    uint64_t seen = 0;
    for (;;) {
        auto new_job = [&] { return generation_.load(std::memory_order_acquire) != seen; };
        if (!spin_until(new_job)) {
            std::unique_lock<std::mutex> lock(mutex_);
            wake_.wait(lock, new_job);
        }
        seen = generation_.load(std::memory_order_acquire);
        if (stop_.load()) return;
        active_.fetch_add(1);
        if (Job* job = job_.load()) run_job(*job, ith);
        active_.fetch_sub(1);
    }
}

}  // namespace sharpi::cpu
