// The Gated DeltaNet ops (cpu/ops/gated_delta_net.h) for tests: the delta rule in its recurrent and
// chunked forms, and the causal conv1d with its rolling state. Type conversion and shape checks only.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

#include "cpu/ops/gated_delta_net.h"
#include "internal.h"
#include "sharpi/errors.h"
#include "threads/thread_pool.h"

namespace py = pybind11;

namespace sharpi::py_bindings {

namespace {

using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;

void expect_shape(const FloatArray& a, std::initializer_list<py::ssize_t> shape, const char* what) {
    bool ok = a.ndim() == static_cast<py::ssize_t>(shape.size());
    size_t i = 0;
    for (py::ssize_t d : shape) ok = ok && a.shape(static_cast<py::ssize_t>(i++)) == d;
    if (!ok) throw InvalidArgument(std::string("[gdn] ") + what + " has the wrong shape");
}

// q, k: [T, n_k, dk] (normalised, q scaled); v: [T, n_v, dv]; g, beta: [T, n_v];
// state: [n_v, dk, dv] (updated in place). chunk_size 0: recurrent form. Returns out [T, n_v, dv].
FloatArray gated_delta_rule(const FloatArray& q, const FloatArray& k, const FloatArray& v,
                            const FloatArray& g, const FloatArray& beta,
                            py::array_t<float, py::array::c_style> state, int64_t chunk_size,
                            bool v_heads_tiled, int threads) {
    if (q.ndim() != 3 || v.ndim() != 3) throw InvalidArgument("[gdn] q and v must be 3-D");
    const py::ssize_t T = q.shape(0), nk = q.shape(1), dk = q.shape(2), nv = v.shape(1), dv = v.shape(2);
    expect_shape(k, {T, nk, dk}, "k");
    expect_shape(v, {T, nv, dv}, "v");
    expect_shape(g, {T, nv}, "g");
    expect_shape(beta, {T, nv}, "beta");
    if (state.ndim() != 3 || state.shape(0) != nv || state.shape(1) != dk || state.shape(2) != dv)
        throw InvalidArgument("[gdn] state has the wrong shape");
    if (nk <= 0 || nv % nk != 0) throw InvalidArgument("[gdn] n_v_heads must be a multiple of n_k_heads");
    FloatArray out({T, nv, dv});
    cpu::GdnShape shape{nk, nv, dk, dv, v_heads_tiled};
    cpu::GdnInputs in{q.data(), nk * dk, k.data(), nk * dk, v.data(), nv * dv, g.data(), beta.data()};
    cpu::ThreadPool pool(threads);
    float* s = state.mutable_data();
    if (chunk_size == 0) {
        cpu::gated_delta_rule_recurrent(pool, in, T, shape, s, out.mutable_data(), nv * dv);
    } else {
        cpu::gated_delta_rule_chunked(pool, in, T, shape, chunk_size, s, out.mutable_data(), nv * dv);
    }
    return out;
}

// x: [T, C]; kernel: [C, K]; state: [K-1, C] (updated in place). Returns silu(conv) [T, C].
FloatArray conv1d_silu(const FloatArray& x, const FloatArray& kernel,
                       py::array_t<float, py::array::c_style> state) {
    if (x.ndim() != 2 || kernel.ndim() != 2) throw InvalidArgument("[gdn] x and kernel must be 2-D");
    const py::ssize_t T = x.shape(0), C = x.shape(1), K = kernel.shape(1);
    expect_shape(kernel, {C, K}, "kernel");
    if (state.ndim() != 2 || state.shape(0) != K - 1 || state.shape(1) != C)
        throw InvalidArgument("[gdn] state has the wrong shape");
    FloatArray y({T, C});
    cpu::conv1d_silu(state.mutable_data(), x.data(), C, T, C, K, kernel.data(), nullptr, y.mutable_data(), C);
    return y;
}

}  // namespace

void bind_gdn(py::module_& m) {
    m.def("gated_delta_rule", &gated_delta_rule, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"),
          py::arg("beta"), py::arg("state"), py::arg("chunk_size") = 0, py::arg("v_heads_tiled") = false,
          py::arg("threads") = 1,
          "Gated delta rule (cpu/ops/gated_delta_net.h); chunk_size 0 = recurrent form. Updates state.");
    m.def("conv1d_silu", &conv1d_silu, py::arg("x"), py::arg("kernel"), py::arg("state"),
          "Causal depthwise conv1d + SiLU with a rolling state (updated in place).");
}

}  // namespace sharpi::py_bindings
