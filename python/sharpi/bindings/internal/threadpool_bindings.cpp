// The thread pool's process-wide cost counters (threads/thread_pool.h ThreadPoolStats), for
// benchmarks/bench_threadpool.py. One pool library in the process (libsharpi_python), so the
// counters include the pools of every Session made through sharpi._core.
#include <pybind11/pybind11.h>

#include "internal.h"
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
}

}  // namespace sharpi::py_bindings
