#include "cpu/threadpool.h"

#include <chrono>

#include "sharpi/errors.h"

namespace sharpi::cpu {

namespace {
// How long a worker spins on the generation counter before blocking. Short: a decode step issues
// parallel_for calls microseconds apart, but spinning longer than that steals a core from others.
constexpr auto kSpinTime = std::chrono::microseconds(200);
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

void ThreadPool::chunk(int64_t n, int ith, int nth, int64_t* begin, int64_t* end) {
    const int64_t base = n / nth, rem = n % nth;
    *begin = ith * base + (ith < rem ? ith : rem);
    *end = *begin + base + (ith < rem ? 1 : 0);
}

void ThreadPool::run_chunk(int ith) {
    int64_t begin, end;
    chunk(n_, ith, n_threads_, &begin, &end);
    if (begin >= end) return;
    try {
        (*body_)(begin, end, ith);
    } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
    }
}

void ThreadPool::parallel_for(int64_t n, const Body& body) {
    if (n <= 0) return;
    if (n_threads_ == 1 || n == 1) {
        body(0, n, 0);
        return;
    }
    body_ = &body;
    n_ = n;
    error_ = nullptr;
    pending_.store(n_threads_ - 1, std::memory_order_relaxed);
    {
        std::lock_guard<std::mutex> lock(mutex_);
        generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    run_chunk(0);
    // Wait for the workers: spin briefly, then yield (the workers are about to finish).
    auto start = std::chrono::steady_clock::now();
    while (pending_.load(std::memory_order_acquire) != 0) {
        if (std::chrono::steady_clock::now() - start > kSpinTime) std::this_thread::yield();
    }
    body_ = nullptr;
    if (error_) std::rethrow_exception(error_);
}

void ThreadPool::worker_main(int ith) {
    uint64_t seen = 0;
    for (;;) {
        auto start = std::chrono::steady_clock::now();
        uint64_t gen;
        while ((gen = generation_.load(std::memory_order_acquire)) == seen) {
            if (std::chrono::steady_clock::now() - start > kSpinTime) {
                std::unique_lock<std::mutex> lock(mutex_);
                wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
            }
        }
        seen = gen;
        if (stop_.load()) return;
        run_chunk(ith);
        pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
}

}  // namespace sharpi::cpu
