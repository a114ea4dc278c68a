// sharpi._core: the C++ engine. Error classes map one-to-one to sharpi/errors.h.
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "cuda_backend.h"
#include "sharpi/errors.h"

namespace py = pybind11;

namespace sharpi::py_bindings {

void bind_errors(py::module_& m) {
    // Registration order matters: pybind11 tries the most recently registered translator first,
    // so bases come before the classes derived from them.
    auto base = py::register_exception<Error>(m, "SharpiError", PyExc_RuntimeError);
    auto format = py::register_exception<FormatError>(m, "FormatError", base.ptr());
    py::register_exception<UnsupportedError>(m, "UnsupportedError", base.ptr());
    py::register_exception<MissingTensorError>(m, "MissingTensorError", format.ptr());
    py::register_exception<IoError>(m, "IoError", base.ptr());
    py::register_exception<InvalidArgument>(m, "InvalidArgument", base.ptr());
    py::register_exception<ContextOverflowError>(m, "ContextOverflowError", base.ptr());
}

}  // namespace sharpi::py_bindings

PYBIND11_MODULE(_core, m) {
    m.doc() = "sharpi C++ engine";
    sharpi::py_bindings::bind_errors(m);
    sharpi::py_bindings::bind_gguf(m);
    sharpi::py_bindings::bind_quant(m);
    sharpi::py_bindings::bind_session(m);
    sharpi::py_bindings::bind_sampler(m);
    sharpi::py_bindings::bind_io(m);
    sharpi::py_bindings::bind_predict(m);
    sharpi::py_bindings::bind_cache(m);
    sharpi::py_bindings::bind_kv(m);
    m.def("cuda_available", &sharpi::cuda::available, "True when built with CUDA and a device is usable");
    m.def("cuda_describe", &sharpi::cuda::describe);
}
