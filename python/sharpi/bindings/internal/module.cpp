// sharpi._internal: see internal.h. Built from the same tree as sharpi._core and linked against the
// same shared engine library (libsharpi_python), so both modules see one thread pool, one set of
// counters and one CUDA runtime.
#include <pybind11/pybind11.h>

#include "internal.h"

namespace py = pybind11;

PYBIND11_MODULE(_internal, m) {
    m.doc() = "sharpi engine internals for the package's planners, tests and benchmarks (not a public API)";
    // The error classes and their translators are _core's (process-wide): importing it first makes
    // every engine error raised here the same sharpi.InvalidArgument, FormatError, ...
    py::module_::import("sharpi._core");
    sharpi::py_bindings::bind_quant(m);
    sharpi::py_bindings::bind_threadpool(m);
    sharpi::py_bindings::bind_io(m);
    sharpi::py_bindings::bind_predict(m);
    sharpi::py_bindings::bind_cache(m);
    sharpi::py_bindings::bind_gdn(m);
    sharpi::py_bindings::bind_kv(m);
    sharpi::py_bindings::bind_cuda(m);
    sharpi::py_bindings::bind_tiers(m);
}
