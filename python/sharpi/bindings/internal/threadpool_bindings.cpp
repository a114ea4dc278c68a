// The thread pool's process-wide cost counters (threads/thread_pool.h ThreadPoolStats), for
// benchmarks/bench_threadpool.py. One pool library in the process (libsharpi_python), so the
// counters include the pools of every Session made through sharpi._core. Also the SIMD read loop
// the decode benchmarks divide by (cpu/ops/read_sweep.h), on a pool of the engine's own threads.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cpu/ops/read_sweep.h"
#include "internal.h"
#include "sharpi/errors.h"
#include "threads/thread_pool.h"

namespace py = pybind11;

namespace sharpi::py_bindings {

void bind_threadpool(py::module_& m) {
    m.def(
        "thread_pool_stats",
        [](bool reset) {
            const cpu::ThreadPoolStats s = cpu::thread_pool_stats();
            if (reset) cpu::reset_thread_pool_stats();
            py::dict d;
            d["regions"] = s.regions;
            d["inline_regions"] = s.inline_regions;
            d["thread_slots"] = s.thread_slots;
            d["region_ns"] = s.region_ns;
            d["busy_ns"] = s.busy_ns;
            d["wake_ns"] = s.wake_ns;
            d["workers_joined"] = s.workers_joined;
            d["workers_late"] = s.workers_late;
            d["workers_missed"] = s.workers_missed;
            d["worker_sleeps"] = s.worker_sleeps;
            d["caller_wait_ns"] = s.caller_wait_ns;
            return d;
        },
        py::arg("reset") = false,
        "Process-wide thread-pool cost counters (threads/thread_pool.h ThreadPoolStats), counted only by "
        "pools "
        "built with SHARPI_POOL_STATS=1; reset: zero them after reading");
    m.def(
        "read_sweep",
        [](py::array_t<uint8_t, py::array::c_style> data, const std::string& isa) {
            if (data.size() % 256 != 0 || reinterpret_cast<uintptr_t>(data.data()) % 64 != 0)
                throw InvalidArgument(
                    "[read bandwidth] read_sweep needs a 64-byte aligned buffer of a multiple "
                    "of 256 bytes, got " +
                    std::to_string(data.size()) + " bytes");
            return cpu::read_sweep(data.data(), static_cast<size_t>(data.size()), isa_arg(isa));
        },
        py::arg("data"), py::arg("isa") = "",
        "XOR of the buffer's little-endian 64-bit words, read by the ISA's read loop (cpu/ops/read_sweep.h)");
    m.def(
        "read_bandwidth",
        [](int threads, size_t bytes, int repeats, const std::string& isa) {
            const cpu::Isa i = isa_arg(isa);
            cpu::ReadBandwidth r;
            {
                py::gil_scoped_release release;
                cpu::ThreadPool pool(std::max(1, threads));
                r = cpu::measure_read_bandwidth(pool, bytes, repeats, i);
            }
            py::dict d;
            d["gbps"] = r.best_bytes_per_s / 1e9;
            d["median_gbps"] = r.median_bytes_per_s / 1e9;
            d["threads"] = std::max(1, threads);
            d["buffer_bytes"] = bytes;
            d["isa"] = cpu::isa_name(i);
            d["checksum"] = r.checksum;
            return d;
        },
        py::arg("threads"), py::arg("bytes") = size_t{1} << 30, py::arg("repeats") = 5, py::arg("isa") = "",
        "Read bandwidth of `threads` engine threads, each XOR-summing its slice of one `bytes` buffer in the "
        "ISA's widest loads (cpu/ops/read_sweep.h): best and median of `repeats` sweeps, GB/s");
}

}  // namespace sharpi::py_bindings
