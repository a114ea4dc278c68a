// Session.expert_stats()'s dict (docs/design.md §7 names), shared by both extension modules: _core's
// Session and the cache harnesses of _internal return the same dict for an ExpertCacheStats.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "sharpi/types.h"

namespace py = pybind11;

namespace sharpi::py_bindings {

py::dict stats_dict(const ExpertCacheStats& st) {
    py::dict d;
    d["tier"] = st.tier;
    d["cpu_experts"] = st.cpu_experts;
    d["miss_copy_bytes_per_s"] = st.miss_copy_bytes_per_s;
    d["miss_copy_latency_s"] = st.miss_copy_latency_s;
    d["miss_cpu_bytes_per_s"] = st.miss_cpu_bytes_per_s;
    d["reader"] = st.reader;
    d["reader_detail"] = st.reader_detail;
    d["reader_note"] = st.reader_note;
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
        ld["prefetch_skipped"] = l.prefetch_skipped;
        ld["predictions"] = l.predictions;
        ld["predicted_correct"] = l.predicted_correct;
        ld["predicted_experts"] = l.predicted_experts;
        ld["hints_dropped"] = l.hints_dropped;
        layers.append(ld);
    }
    d["layers"] = layers;
    d["expert_accesses"] = py::array_t<uint64_t>(st.expert_accesses.size(), st.expert_accesses.data());
    d["expert_misses"] = py::array_t<uint64_t>(st.expert_misses.size(), st.expert_misses.data());
    d["io_busy_ms"] = st.io_busy_ms;
    d["decode_ms"] = st.decode_ms;
    d["predict_ms"] = st.predict_ms;
    d["predictor_calls"] = st.predictor_calls;
    d["predictor_failures"] = st.predictor_failures;
    return d;
}

}  // namespace sharpi::py_bindings
