// sharpi._core: the C++ engine's public API (cpp/include/sharpi/). Error classes map one-to-one to
// sharpi/errors.h; their translators are process-wide, so sharpi._internal (which imports this module
// first) raises the same classes.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstring>

#include "bindings.h"
#include "sharpi/errors.h"

namespace py = pybind11;

namespace sharpi::py_bindings {

void bind_errors(py::module_& m) {
    // Registration order matters: pybind11 tries the most recently registered translator first,
    // so bases come before the classes derived from them.
    auto base = py::register_exception<Error>(m, "SharpiError", PyExc_RuntimeError);
    auto format = py::register_exception<FormatError>(m, "FormatError", base.ptr());
    auto unsupported = py::register_exception<UnsupportedError>(m, "UnsupportedError", base.ptr());
    auto missing = py::register_exception<MissingTensorError>(m, "MissingTensorError", format.ptr());
    auto io = py::register_exception<IoError>(m, "IoError", base.ptr());
    auto invalid = py::register_exception<InvalidArgument>(m, "InvalidArgument", base.ptr());
    auto overflow = py::register_exception<ContextOverflowError>(m, "ContextOverflowError", base.ptr());
    auto cancelled = py::register_exception<CancelledError>(m, "CancelledError", base.ptr());
    auto device = py::register_exception<DeviceError>(m, "DeviceError", base.ptr());
    // Tried before the translators above (registered later). Messages quote names and values from
    // files, which need not be UTF-8 (a fuzzer found an architecture name with a stray byte):
    // pybind11's default PyErr_SetString would decode strictly and raise UnicodeDecodeError instead
    // of the typed error. Invalid bytes become \xNN.
    // Raw pointers (translators are plain functions): the module owns the types for the life of
    // the process.
    static PyObject* types[9];
    PyObject* const all[9] = {base.ptr(),    format.ptr(),   unsupported.ptr(), missing.ptr(), io.ptr(),
                              invalid.ptr(), overflow.ptr(), cancelled.ptr(),   device.ptr()};
    std::copy(all, all + 9, types);
    py::register_exception_translator([](std::exception_ptr p) {
        auto raise = [](PyObject* type, const char* what) {
            PyObject* msg =
                PyUnicode_DecodeUTF8(what, static_cast<Py_ssize_t>(std::strlen(what)), "backslashreplace");
            if (msg == nullptr) return;  // out of memory: that error is already set
            PyErr_SetObject(type, msg);
            Py_DECREF(msg);
        };
        PyObject *const base = types[0], *const format = types[1], *const unsupported = types[2],
                        *const missing = types[3], *const io = types[4], *const invalid = types[5],
                        *const overflow = types[6], *const cancelled = types[7], *const device = types[8];
        try {
            if (p) std::rethrow_exception(p);
        } catch (const MissingTensorError& e) {
            raise(missing, e.what());
        } catch (const FormatError& e) {
            raise(format, e.what());
        } catch (const UnsupportedError& e) {
            raise(unsupported, e.what());
        } catch (const IoError& e) {
            raise(io, e.what());
        } catch (const InvalidArgument& e) {
            raise(invalid, e.what());
        } catch (const ContextOverflowError& e) {
            raise(overflow, e.what());
        } catch (const CancelledError& e) {
            raise(cancelled, e.what());
        } catch (const DeviceError& e) {
            raise(device, e.what());
        } catch (const Error& e) {
            raise(base, e.what());
        }
    });
}

}  // namespace sharpi::py_bindings

PYBIND11_MODULE(_core, m) {
    m.doc() =
        "sharpi C++ engine: the public API (session, options, predictor plug-in, errors, sampler, GGUF "
        "reading)";
    sharpi::py_bindings::bind_errors(m);
    sharpi::py_bindings::bind_gguf(m);
    sharpi::py_bindings::bind_session(m);
    sharpi::py_bindings::bind_sampler(m);
}
