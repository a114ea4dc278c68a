// Python binding of sharpi::Sampler: type conversion only; every check lives in sampler.cpp.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bindings.h"
#include "sharpi/options.h"
#include "sharpi/session.h"

namespace py = pybind11;

namespace sharpi::py_bindings {

void bind_sampler(py::module_& m) {
    const SamplingParams defaults;
    py::class_<Sampler>(m, "Sampler",
                        "Samples one token id from a row of logits: repetition penalty, then top-k, top-p,\n"
                        "min-p, temperature (0 = greedy argmax, ties to the lowest id), seeded RNG.\n"
                        "Raises InvalidArgument for out-of-range settings or bad logits.")
        .def(py::init([](float temperature, int32_t top_k, float top_p, float min_p, float repeat_penalty,
                         int32_t repeat_last_n, uint64_t seed) {
                 SamplingParams p;
                 p.temperature = temperature;
                 p.top_k = top_k;
                 p.top_p = top_p;
                 p.min_p = min_p;
                 p.repeat_penalty = repeat_penalty;
                 p.repeat_last_n = repeat_last_n;
                 p.seed = seed;
                 return Sampler(p);
             }),
             py::kw_only(), py::arg("temperature") = defaults.temperature, py::arg("top_k") = defaults.top_k,
             py::arg("top_p") = defaults.top_p, py::arg("min_p") = defaults.min_p,
             py::arg("repeat_penalty") = defaults.repeat_penalty,
             py::arg("repeat_last_n") = defaults.repeat_last_n, py::arg("seed") = defaults.seed)
        .def(
            "sample",
            [](Sampler& self, const py::array_t<float, py::array::c_style | py::array::forcecast>& logits,
               const std::vector<token_t>& recent) {
                if (logits.ndim() != 1) {
                    throw InvalidArgument("[sampler] logits must be a 1-D array [n_vocab], got " +
                                          std::to_string(logits.ndim()) + " dimensions");
                }
                const float* data = logits.data();
                const int64_t n_vocab = static_cast<int64_t>(logits.shape(0));
                py::gil_scoped_release release;
                return self.sample(data, n_vocab, recent);
            },
            py::arg("logits"), py::arg("recent") = std::vector<token_t>{},
            "logits: float32 [n_vocab]; recent: the token ids generated so far (prompt included), the\n"
            "last repeat_last_n of which are penalized. Returns the sampled token id.")
        .def_property_readonly("temperature", [](const Sampler& s) { return s.params().temperature; })
        .def_property_readonly("top_k", [](const Sampler& s) { return s.params().top_k; })
        .def_property_readonly("top_p", [](const Sampler& s) { return s.params().top_p; })
        .def_property_readonly("min_p", [](const Sampler& s) { return s.params().min_p; })
        .def_property_readonly("repeat_penalty", [](const Sampler& s) { return s.params().repeat_penalty; })
        .def_property_readonly("repeat_last_n", [](const Sampler& s) { return s.params().repeat_last_n; })
        .def_property_readonly("seed", [](const Sampler& s) { return s.params().seed; })
        .def("__repr__", [](const Sampler& s) {
            const SamplingParams& p = s.params();
            return "Sampler(temperature=" + std::to_string(p.temperature) +
                   ", top_k=" + std::to_string(p.top_k) + ", top_p=" + std::to_string(p.top_p) +
                   ", min_p=" + std::to_string(p.min_p) +
                   ", repeat_penalty=" + std::to_string(p.repeat_penalty) +
                   ", repeat_last_n=" + std::to_string(p.repeat_last_n) + ", seed=" + std::to_string(p.seed) +
                   ")";
        });
}

}  // namespace sharpi::py_bindings
