// The memory read loop the decode benchmarks divide by (issue 42: "decode x bytes per token /
// read bandwidth >= 0.8", the bandwidth measured by a SIMD read loop on the same threads, since
// numpy's reductions are compute-bound on some machines and report 33-56 GB/s for the same DRAM).
//
// read_sweep loads every byte of [data, data + bytes) once in the widest vectors the ISA has, with
// several independent accumulators so that the loads, not an add chain, bound it, and returns a
// value that depends on every load (the compiler cannot drop them). measure_read_bandwidth runs it
// on every thread of a pool over disjoint slices of one buffer, as the matmuls read their weights.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpu/quant/kernels.h"
#include "threads/thread_pool.h"

namespace sharpi::cpu {

// XOR of the buffer's 64-bit words (bytes a multiple of 256, data 64-byte aligned).
uint64_t read_sweep(const void* data, size_t bytes, Isa isa);

namespace detail {
uint64_t read_sweep_avx2(const void* data, size_t bytes);
uint64_t read_sweep_avx512(const void* data, size_t bytes);
}  // namespace detail

struct ReadBandwidth {
    double best_bytes_per_s = 0.0;    // the fastest of the repeats
    double median_bytes_per_s = 0.0;  // the median of the repeats
    uint64_t checksum = 0;            // XOR of every sweep's result (keeps the loads observable)
};

// `repeats` timed sweeps (after one untimed, which also faults the pages in) of a buffer of
// `bytes` (rounded up to 256 per thread) split evenly over the pool's threads. Throws
// InvalidArgument when bytes or repeats is < 1.
ReadBandwidth measure_read_bandwidth(ThreadPool& pool, size_t bytes, int repeats, Isa isa);

}  // namespace sharpi::cpu
