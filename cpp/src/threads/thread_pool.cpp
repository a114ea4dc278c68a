#include "threads/thread_pool.h"

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "sharpi/errors.h"

namespace sharpi {

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

bool stats_requested() {
    const char* v = std::getenv("SHARPI_POOL_STATS");
    return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
}

uint64_t now_ns() {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::steady_clock::now().time_since_epoch())
                                     .count());
}

// ThreadPoolStats as atomics: workers add to them concurrently (relaxed: they are sums read later).
struct StatCounters {
    std::atomic<uint64_t> regions{0}, inline_regions{0}, thread_slots{0}, region_ns{0}, busy_ns{0},
        wake_ns{0}, workers_joined{0}, workers_late{0}, workers_missed{0}, worker_sleeps{0},
        caller_wait_ns{0};
};
StatCounters g_stats;

void add(std::atomic<uint64_t>& counter, uint64_t v) {
    counter.fetch_add(v, std::memory_order_relaxed);
}
}  // namespace

ThreadPoolStats thread_pool_stats() {
    auto get = [](const std::atomic<uint64_t>& c) { return c.load(std::memory_order_relaxed); };
    ThreadPoolStats s;
    s.regions = get(g_stats.regions);
    s.inline_regions = get(g_stats.inline_regions);
    s.thread_slots = get(g_stats.thread_slots);
    s.region_ns = get(g_stats.region_ns);
    s.busy_ns = get(g_stats.busy_ns);
    s.wake_ns = get(g_stats.wake_ns);
    s.workers_joined = get(g_stats.workers_joined);
    s.workers_late = get(g_stats.workers_late);
    s.workers_missed = get(g_stats.workers_missed);
    s.worker_sleeps = get(g_stats.worker_sleeps);
    s.caller_wait_ns = get(g_stats.caller_wait_ns);
    return s;
}

void reset_thread_pool_stats() {
    for (auto* c : {&g_stats.regions, &g_stats.inline_regions, &g_stats.thread_slots, &g_stats.region_ns,
                    &g_stats.busy_ns, &g_stats.wake_ns, &g_stats.workers_joined, &g_stats.workers_late,
                    &g_stats.workers_missed, &g_stats.worker_sleeps, &g_stats.caller_wait_ns})
        c->store(0, std::memory_order_relaxed);
}

void ThreadPool::note_inline_region() {
    add(g_stats.inline_regions, 1);
}

int hardware_threads() {
    unsigned n = std::thread::hardware_concurrency();
    return n == 0 ? 1 : static_cast<int>(n);
}

ThreadPool::ThreadPool(int n_threads) : n_threads_(n_threads), stats_(stats_requested()) {
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

bool ThreadPool::run_job(Job& job, int ith) {
    uint64_t busy_ns = 0;
    bool ran = false;
    for (;;) {
        const int64_t i = job.next.fetch_add(1, std::memory_order_relaxed);
        if (i >= job.n_chunks) break;
        int64_t begin, end;
        chunk(job.n, i, job.n_chunks, &begin, &end);
        const uint64_t t0 = stats_ ? now_ns() : 0;
        try {
            (*job.body)(begin, end, ith);
        } catch (...) {
            std::lock_guard<std::mutex> lock(error_mutex_);
            if (!error_) error_ = std::current_exception();
        }
        if (stats_) busy_ns += now_ns() - t0;
        ran = true;
        job.done.fetch_add(1, std::memory_order_release);
    }
    if (stats_) add(g_stats.busy_ns, busy_ns);
    return ran;
}

void ThreadPool::parallel_for(int64_t n, const Body& body) {
    parallel_for(n, body, n_threads_ * kChunksPerThread);
}

void ThreadPool::parallel_for(int64_t n, const Body& body, int64_t n_chunks) {
    if (n <= 0) return;
    if (n_threads_ == 1 || n == 1) {
        if (stats_) note_inline_region();
        body(0, n, 0);
        return;
    }
    Job job;
    job.body = &body;
    job.n = n;
    job.n_chunks = std::min<int64_t>(n, std::max<int64_t>(1, n_chunks));
    if (stats_) job.dispatch_ns = now_ns();
    error_ = nullptr;
    job_.store(&job);
    {
        std::lock_guard<std::mutex> lock(mutex_);
        generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    run_job(job, 0);
    const uint64_t caller_done_ns = stats_ ? now_ns() : 0;
    // Every chunk is claimed; wait only for chunks still running on workers (a worker that was
    // never scheduled claimed nothing and is not waited for): spin briefly, then yield.
    auto finished = [&job] { return job.done.load(std::memory_order_acquire) == job.n_chunks; };
    while (!spin_until(finished)) std::this_thread::yield();
    // Unpublish the job, then wait out workers that picked up the pointer (they find no chunk left).
    job_.store(nullptr);
    while (active_.load() != 0) _mm_pause();
    if (stats_) {
        const uint64_t end_ns = now_ns();
        add(g_stats.regions, 1);
        add(g_stats.thread_slots, static_cast<uint64_t>(n_threads_));
        add(g_stats.region_ns, end_ns - job.dispatch_ns);
        add(g_stats.caller_wait_ns, end_ns - caller_done_ns);
    }
    if (error_) std::rethrow_exception(error_);
}

void ThreadPool::worker_main(int ith) {
    uint64_t seen = 0;
    for (;;) {
        auto new_job = [&] { return generation_.load(std::memory_order_acquire) != seen; };
        if (!spin_until(new_job)) {
            if (stats_) add(g_stats.worker_sleeps, 1);
            std::unique_lock<std::mutex> lock(mutex_);
            wake_.wait(lock, new_job);
        }
        seen = generation_.load(std::memory_order_acquire);
        if (stop_.load()) return;
        active_.fetch_add(1);
        if (Job* job = job_.load()) {
            // The job stays alive while active_ counts this worker (parallel_for waits it out).
            const uint64_t joined_ns = stats_ ? now_ns() : 0;
            const bool ran = run_job(*job, ith);
            if (stats_) {
                add(g_stats.wake_ns, joined_ns - job->dispatch_ns);
                add(g_stats.workers_joined, 1);
                if (!ran) add(g_stats.workers_late, 1);
            }
        } else if (stats_ && !stop_.load()) {
            add(g_stats.workers_missed, 1);
        }
        active_.fetch_sub(1);
    }
}

}  // namespace sharpi
