// sharpi._core.ReplacementPolicy: the expert cache's replacement policies (cpp/src/moe/
// replacement_policy.h) seen from Python, so trace replay and Belady comparisons
// (python/sharpi/belady.py) run the engine's own policy code. Type conversion only.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "bindings.h"
#include "moe/replacement_policy.h"

namespace py = pybind11;

namespace sharpi::py_bindings {

void bind_cache(py::module_& m) {
    py::class_<ReplacementPolicy, std::unique_ptr<ReplacementPolicy>>(
        m, "ReplacementPolicy",
        "An expert-cache replacement policy over slot ids (small ints the caller hands out).\n"
        "ReplacementPolicy(name, capacity, probation=0.25): name from replacement_policy_names();\n"
        "probation: SLRU's probation share in (0, 1] (1 = plain LRU).")
        .def(py::init([](const std::string& name, uint64_t capacity, double probation) {
                 ReplacementPolicyOptions options;
                 options.probation = probation;
                 return make_replacement_policy(name, capacity, options);
             }),
             py::arg("name"), py::arg("capacity"), py::arg("probation") = 0.25)
        .def_property_readonly("name", [](const ReplacementPolicy& p) { return std::string(p.name()); })
        .def("insert", &ReplacementPolicy::insert, py::arg("slot"),
             "slot now caches an expert (a miss filled)")
        .def("touch", &ReplacementPolicy::touch, py::arg("slot"), "a cached slot was used again (a hit)")
        .def("remove", &ReplacementPolicy::remove, py::arg("slot"), "slot left the cache (evicted)")
        .def("__contains__", &ReplacementPolicy::contains, py::arg("slot"))
        .def("__len__", &ReplacementPolicy::size)
        .def(
            "victim",
            [](const ReplacementPolicy& p, std::vector<uint32_t> pinned) -> py::object {
                std::sort(pinned.begin(), pinned.end());
                const uint32_t v = p.victim(
                    [&](uint32_t s) { return !std::binary_search(pinned.begin(), pinned.end(), s); });
                return v == ReplacementPolicy::kNone ? py::object(py::none()) : py::object(py::int_(v));
            },
            py::arg("pinned") = std::vector<uint32_t>{},
            "The slot the policy evicts next, skipping `pinned` (None when every cached slot is pinned); "
            "does not evict it");
    m.def("replacement_policy_names", &replacement_policy_names);
}

}  // namespace sharpi::py_bindings
