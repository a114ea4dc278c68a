#include "cpu/ops/read_sweep.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "sharpi/errors.h"

namespace sharpi::cpu {

namespace {

uint64_t read_sweep_scalar(const void* data, size_t bytes) {
    const uint64_t* p = static_cast<const uint64_t*>(data);
    uint64_t a[4] = {0, 0, 0, 0};
    for (size_t i = 0; i < bytes / 8; i += 4) {
        for (int k = 0; k < 4; ++k) a[k] ^= p[i + k];
    }
    return a[0] ^ a[1] ^ a[2] ^ a[3];
}

constexpr size_t kSweepStep = 256;  // every ISA's loop consumes 256 bytes per iteration

struct FreeDeleter {
    void operator()(uint8_t* p) const { std::free(p); }
};

}  // namespace

uint64_t read_sweep(const void* data, size_t bytes, Isa isa) {
    switch (isa) {
        case Isa::avx512:
            return detail::read_sweep_avx512(data, bytes);
        case Isa::avx2:
            return detail::read_sweep_avx2(data, bytes);
        case Isa::scalar:
            break;
    }
    return read_sweep_scalar(data, bytes);
}

ReadBandwidth measure_read_bandwidth(ThreadPool& pool, size_t bytes, int repeats, Isa isa) {
    if (bytes < 1 || repeats < 1)
        throw InvalidArgument("[read bandwidth] bytes and repeats must be >= 1, got " +
                              std::to_string(bytes) + " and " + std::to_string(repeats));
    const int n = pool.n_threads();
    const size_t slice = (bytes / static_cast<size_t>(n) + kSweepStep - 1) / kSweepStep * kSweepStep;
    const size_t total = slice * static_cast<size_t>(n);
    std::unique_ptr<uint8_t, FreeDeleter> buffer(static_cast<uint8_t*>(std::aligned_alloc(64, total)));
    if (!buffer) throw std::bad_alloc();
    uint8_t* base = buffer.get();
    // Each thread writes its own slice first, so its pages sit on its node (first touch), as a
    // loaded model's weights sit wherever the threads that fault them in run.
    pool.parallel_for(
        n,
        [&](int64_t begin, int64_t end, int) {
            for (int64_t t = begin; t < end; ++t)
                std::memset(base + static_cast<size_t>(t) * slice, 0x5a, slice);
        },
        n);
    std::vector<uint64_t> sums(static_cast<size_t>(n), 0);
    auto sweep_all = [&] {
        pool.parallel_for(
            n,
            [&](int64_t begin, int64_t end, int) {
                for (int64_t t = begin; t < end; ++t)
                    sums[static_cast<size_t>(t)] ^=
                        read_sweep(base + static_cast<size_t>(t) * slice, slice, isa);
            },
            n);
    };
    sweep_all();  // untimed
    std::vector<double> rates;
    for (int r = 0; r < repeats; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        sweep_all();
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        rates.push_back(static_cast<double>(total) / std::max(s, 1e-9));
    }
    std::sort(rates.begin(), rates.end());
    ReadBandwidth out;
    out.best_bytes_per_s = rates.back();
    out.median_bytes_per_s = rates[rates.size() / 2];
    for (uint64_t s : sums) out.checksum ^= s;
    return out;
}

}  // namespace sharpi::cpu
