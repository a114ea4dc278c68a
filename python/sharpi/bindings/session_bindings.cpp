// sharpi._core.Session: type conversion around sharpi::Session. Compute runs with the GIL
// released; a per-session mutex serialises Python threads that share one session.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <mutex>

#include "bindings.h"
#include "sharpi/session.h"

namespace py = pybind11;

namespace sharpi::py_bindings {

namespace {

struct PySession {
    std::unique_ptr<Session> session;
    std::mutex mutex;
};

// Moves a vector into a numpy array without copying (the capsule owns it).
py::array_t<float> to_numpy(std::vector<float>&& v, std::vector<py::ssize_t> shape) {
    auto* owned = new std::vector<float>(std::move(v));
    py::capsule free_when_done(owned, [](void* p) { delete static_cast<std::vector<float>*>(p); });
    return py::array_t<float>(shape, owned->data(), free_when_done);
}

py::dict info_dict(const ModelInfo& i) {
    py::dict d;
    d["path"] = i.path;
    d["arch"] = i.arch;
    d["name"] = i.name;
    d["n_vocab"] = i.n_vocab;
    d["n_embd"] = i.n_embd;
    d["n_layer"] = i.n_layer;
    d["n_head"] = i.n_head;
    d["n_head_kv"] = i.n_head_kv;
    d["head_dim"] = i.head_dim;
    d["n_ff"] = i.n_ff;
    d["n_ff_exp"] = i.n_ff_exp;
    d["n_ff_shexp"] = i.n_ff_shexp;
    d["n_expert"] = i.n_expert;
    d["n_expert_used"] = i.n_expert_used;
    d["n_ctx_train"] = i.n_ctx_train;
    d["n_ctx"] = i.n_ctx;
    d["bytes_dense"] = i.bytes_dense;
    d["bytes_experts"] = i.bytes_experts;
    return d;
}

py::dict stats_dict(const ExpertCacheStats& st) {
    py::dict d;
    d["reader"] = st.reader;
    d["n_slots"] = st.n_slots;
    d["n_staging"] = st.n_staging;
    d["slot_bytes"] = st.slot_bytes;
    d["budget_bytes"] = st.budget_bytes;
    d["fixed_bytes"] = st.fixed_bytes;
    py::list layers;
    for (const LayerExpertStats& l : st.layers) {
        py::dict ld;
        ld["accesses"] = l.accesses;
        ld["hits"] = l.hits;
        ld["misses"] = l.misses;
        ld["evictions"] = l.evictions;
        ld["bytes_read"] = l.bytes_read;
        ld["stall_ms"] = l.stall_ms;
        ld["prefetch_issued"] = l.prefetch_issued;
        ld["prefetch_used"] = l.prefetch_used;
        ld["prefetch_timely"] = l.prefetch_timely;
        ld["prefetch_late"] = l.prefetch_late;
        ld["prefetch_wasted_bytes"] = l.prefetch_wasted_bytes;
        layers.append(ld);
    }
    d["layers"] = layers;
    d["expert_accesses"] = py::array_t<uint64_t>(st.expert_accesses.size(), st.expert_accesses.data());
    d["expert_misses"] = py::array_t<uint64_t>(st.expert_misses.size(), st.expert_misses.data());
    return d;
}

}  // namespace

void bind_session(py::module_& m) {
    m.def("parse_byte_size", &parse_byte_size, py::arg("text"), "\"6GiB\" -> 6442450944 (InvalidArgument if malformed)");
    py::class_<PySession>(m, "Session")
        .def(py::init([](const std::string& path, int threads, int n_ctx, bool exact, bool dump_activations,
                         uint64_t ram_budget, double slru_probation, const std::string& reader, bool timeline,
                         const std::string& prefetch) {
                 SessionOptions o;
                 o.n_threads = threads;
                 o.n_ctx = n_ctx;
                 o.exact = exact;
                 o.dump_activations = dump_activations;
                 o.ram_budget = ram_budget;
                 o.slru_probation = slru_probation;
                 o.reader = reader;
                 o.timeline = timeline;
                 o.prefetch = prefetch;
                 auto s = std::make_unique<PySession>();
                 py::gil_scoped_release release;
                 s->session = std::make_unique<Session>(path, o);
                 return s;
             }),
             py::arg("path"), py::arg("threads") = 0, py::arg("n_ctx") = 0, py::arg("exact") = false,
             py::arg("dump_activations") = false, py::arg("ram_budget") = 0, py::arg("slru_probation") = 0.25,
             py::arg("reader") = "auto", py::arg("timeline") = false, py::arg("prefetch") = "none")
        .def_property_readonly("info", [](PySession& s) { return info_dict(s.session->info()); })
        .def_property_readonly("n_past", [](PySession& s) { return s.session->n_past(); })
        .def(
            "decode",
            [](PySession& s, std::vector<token_t> tokens, bool all_logits) {
                std::vector<float> logits;
                const int64_t n_vocab = s.session->info().n_vocab;
                {
                    py::gil_scoped_release release;
                    std::lock_guard<std::mutex> lock(s.mutex);
                    logits = s.session->decode(tokens, all_logits);
                }
                if (all_logits) {
                    return to_numpy(std::move(logits), {static_cast<py::ssize_t>(tokens.size()), n_vocab});
                }
                return to_numpy(std::move(logits), {n_vocab});
            },
            py::arg("tokens"), py::arg("all_logits") = false,
            "Append tokens and return f32 logits: [n_vocab] for the last token or [n_tokens, n_vocab].")
        .def("reset",
             [](PySession& s) {
                 std::lock_guard<std::mutex> lock(s.mutex);
                 s.session->reset();
             })
        .def("dump",
             [](PySession& s) {
                 py::dict d;
                 for (const auto& [name, act] : s.session->dump()) {
                     std::vector<float> copy = act.data;
                     std::vector<py::ssize_t> shape(act.shape.begin(), act.shape.end());
                     d[py::str(name)] = to_numpy(std::move(copy), shape);
                 }
                 return d;
             })
        .def(
            "set_route_trace",
            [](PySession& s, py::array_t<int32_t, py::array::c_style | py::array::forcecast> experts) {
                if (experts.size() == 0) {
                    s.session->set_route_trace({}, 0, 0, 0);
                    return;
                }
                if (experts.ndim() != 3) {
                    throw InvalidArgument("route trace must be a 3-D array [tokens, layers, top_k], got " +
                                          std::to_string(experts.ndim()) + " dimensions");
                }
                std::vector<int32_t> flat(experts.data(), experts.data() + experts.size());
                std::lock_guard<std::mutex> lock(s.mutex);
                s.session->set_route_trace(flat, experts.shape(0), experts.shape(1), experts.shape(2));
            },
            py::arg("experts"))
        .def("last_routing",
             [](PySession& s) {
                 py::list out;
                 const int64_t k = s.session->info().n_expert_used;
                 for (std::vector<int32_t>& ids : s.session->last_routing()) {
                     const py::ssize_t n = k > 0 ? static_cast<py::ssize_t>(ids.size()) / k : 0;
                     out.append(py::array_t<int32_t>({n, static_cast<py::ssize_t>(k)}, ids.data()));
                 }
                 return out;
             })
        .def("timeline_events",
             [](PySession& s) {
                 py::list out;
                 for (const TimelineEvent& e : s.session->timeline_events()) {
                     py::dict d;
                     d["track"] = e.track;
                     d["name"] = e.name;
                     d["start_us"] = e.start_us;
                     d["dur_us"] = e.dur_us;
                     out.append(d);
                 }
                 return out;
             })
        .def("clear_timeline", [](PySession& s) { s.session->clear_timeline(); })
        .def("expert_stats", [](PySession& s) { return stats_dict(s.session->expert_stats()); })
        .def("reset_stats",
             [](PySession& s) {
                 std::lock_guard<std::mutex> lock(s.mutex);
                 s.session->reset_stats();
             })
        .def("metadata_string", [](PySession& s, const std::string& key) { return s.session->metadata_string(key); });
}

}  // namespace sharpi::py_bindings
