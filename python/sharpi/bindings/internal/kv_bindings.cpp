// KV cache types, the attention ops over them (GQA and MLA), and the RAM budget planner, for tests, `sharpi
// inspect` and benchmarks. Type conversion and size checks only; the work is in model/kv_cache,
// cpu/ops/attention and memory_plan.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <optional>
#include <string>

#include "cpu/ops/attention.h"
#include "cpu/ops/lightning_indexer.h"
#include "cpu/ops/mla_attention.h"
#include "engine.h"
#include "internal.h"
#include "memory_plan.h"
#include "model/kv_cache.h"
#include "model/model.h"
#include "sharpi/errors.h"
#include "threads/thread_pool.h"

namespace py = pybind11;

namespace sharpi::py_bindings {

namespace {

using ByteArray = py::array_t<uint8_t, py::array::c_style>;
using FloatArray = py::array_t<float, py::array::c_style>;
using IntArray = py::array_t<int32_t, py::array::c_style>;

ByteArray kv_store_row_py(const std::string& type_name, const FloatArray& x) {
    const GgmlType type = parse_kv_type(type_name);
    const int64_t n = x.size();
    const int64_t block = ggml_type_traits(type).block_size;
    if (x.ndim() != 1 || n % block != 0) {
        throw InvalidArgument("[kv] a row of " + type_name +
                              " needs a 1-D array whose length is a multiple of " + std::to_string(block));
    }
    ByteArray out(static_cast<py::ssize_t>(ggml_row_size(type, n)));
    kv_store_row(type, x.data(), out.mutable_data(), n);
    return out;
}

// Runs fn(pool) on a pool of `threads` threads (at least one) with the GIL released.
template <class Fn>
void run_on_pool(int threads, Fn&& fn) {
    py::gil_scoped_release release;
    cpu::ThreadPool pool(std::max(1, threads));
    fn(pool);
}

// Stored rows a kernel reads: a 2-D uint8 array of at least n_rows rows of row_bytes each.
void check_stored_rows(const ByteArray& a, size_t row_bytes, int64_t n_rows, const std::string& what) {
    if (a.ndim() != 2 || static_cast<size_t>(a.shape(1)) != row_bytes || a.shape(0) < n_rows) {
        throw InvalidArgument(what + " must be [>= pos0 + n_tokens, " + std::to_string(row_bytes) +
                              "] rows of their type");
    }
}

// q: [n_tokens, n_head * head_dim] f32; k, v: [n_kv, row_bytes] uint8 rows as kv_store_row wrote them.
FloatArray attention_py(const FloatArray& q, const ByteArray& k, const ByteArray& v,
                        const std::string& type_k, const std::string& type_v, int64_t pos0, int64_t n_head,
                        int64_t n_head_kv, int64_t head_dim, float scale, int threads, const std::string& isa,
                        int64_t window, std::optional<FloatArray> sinks, bool exact, int64_t chunk) {
    cpu::AttentionShape shape{n_head, n_head_kv, head_dim, scale};
    shape.window = std::max<int64_t>(0, window);
    shape.chunk = std::max<int64_t>(0, chunk);
    shape.exact = exact;
    if (sinks) {
        if (sinks->ndim() != 1 || sinks->shape(0) != n_head)
            throw InvalidArgument("[attention] sinks must be [n_head]");
        shape.sinks = sinks->data();
    }
    if (n_head <= 0 || n_head_kv <= 0 || head_dim <= 0 || n_head % n_head_kv != 0) {
        throw InvalidArgument("[attention] bad head counts");
    }
    if (q.ndim() != 2 || q.shape(1) != n_head * head_dim) {
        throw InvalidArgument("[attention] q must be [n_tokens, n_head * head_dim]");
    }
    const int64_t n_tokens = q.shape(0);
    const GgmlType tk = parse_kv_type(type_k), tv = parse_kv_type(type_v);
    const size_t rk = ggml_row_size(tk, n_head_kv * head_dim), rv = ggml_row_size(tv, n_head_kv * head_dim);
    check_stored_rows(k, rk, pos0 + n_tokens, "[attention] k / v");
    check_stored_rows(v, rv, pos0 + n_tokens, "[attention] k / v");
    const cpu::Isa i = isa_arg(isa);
    FloatArray out({n_tokens, n_head * head_dim});
    float* dst = out.mutable_data();
    run_on_pool(threads, [&](cpu::ThreadPool& pool) {
        cpu::attention(pool, q.data(), n_head * head_dim, cpu::KvRows{k.data(), rk, tk},
                       cpu::KvRows{v.data(), rv, tv}, n_tokens, pos0, shape, dst, n_head * head_dim, i);
    });
    return out;
}

// Fast mode's block kernels on one block (cpu::attention_block_partial): q [rows, head_dim],
// k / v [keys, head_dim] f32, lo / hi [rows] int64. Returns (m [rows], l [rows], o [rows, head_dim]).
py::tuple attention_block_kernels_py(const std::string& isa, const FloatArray& q, const FloatArray& k,
                                     const FloatArray& v, const py::array_t<int64_t, py::array::c_style>& lo,
                                     const py::array_t<int64_t, py::array::c_style>& hi, float scale) {
    if (q.ndim() != 2 || k.ndim() != 2 || v.ndim() != 2 || k.shape(1) != q.shape(1) ||
        v.shape(1) != q.shape(1) || v.shape(0) != k.shape(0) || lo.ndim() != 1 || hi.ndim() != 1 ||
        lo.shape(0) != q.shape(0) || hi.shape(0) != q.shape(0)) {
        throw InvalidArgument("[attention] block kernels: q [rows, d], k / v [keys, d], lo / hi [rows]");
    }
    const int64_t n_rows = q.shape(0), head_dim = q.shape(1);
    FloatArray m({n_rows}), l({n_rows}), o({n_rows, head_dim});
    cpu::attention_block_partial(isa_arg(isa), q.data(), n_rows, k.data(), v.data(), k.shape(0), head_dim,
                                 lo.data(), hi.data(), scale, m.mutable_data(), l.mutable_data(),
                                 o.mutable_data());
    return py::make_tuple(m, l, o);
}

// q_abs: [n_tokens, n_head * (n_lora_kv + n_rot)] f32; latent: [n_kv, row_bytes] uint8 rows as
// kv_store_row wrote them.
FloatArray mla_attention_py(const FloatArray& q_abs, const ByteArray& latent, const std::string& type,
                            int64_t pos0, int64_t n_head, int64_t n_lora_kv, int64_t n_rot, float scale,
                            int threads, const std::string& isa, const std::optional<IntArray>& positions,
                            const std::optional<IntArray>& count) {
    if (n_head <= 0 || n_lora_kv <= 0 || n_rot < 0) throw InvalidArgument("[mla_attention] bad shape");
    const int64_t key_width = n_lora_kv + n_rot;
    if (q_abs.ndim() != 2 || q_abs.shape(1) != n_head * key_width) {
        throw InvalidArgument("[mla_attention] q_abs must be [n_tokens, n_head * (n_lora_kv + n_rot)]");
    }
    const int64_t n_tokens = q_abs.shape(0);
    const GgmlType t = parse_kv_type(type);
    const size_t row = ggml_row_size(t, key_width);
    check_stored_rows(latent, row, pos0 + n_tokens, "[mla_attention] latent");
    const cpu::Isa i = isa_arg(isa);
    FloatArray out({n_tokens, n_head * n_lora_kv});
    float* dst = out.mutable_data();
    const cpu::MlaShape shape{n_head, n_lora_kv, n_rot, scale};
    MlaSelection selection;
    if (positions.has_value() != count.has_value()) {
        throw InvalidArgument("[mla_attention] a selection needs both positions and count");
    }
    if (positions) {
        if (positions->ndim() != 2 || positions->shape(0) != n_tokens || count->ndim() != 1 ||
            count->shape(0) != n_tokens) {
            throw InvalidArgument("[mla_attention] positions must be [n_tokens, k], count [n_tokens]");
        }
        for (int64_t tk = 0; tk < n_tokens; ++tk) {
            const int32_t c = count->data()[tk];
            if (c < 1 || c > positions->shape(1)) throw InvalidArgument("[mla_attention] count out of range");
            for (int32_t j = 0; j < c; ++j) {
                const int32_t p = positions->data()[tk * positions->shape(1) + j];
                if (p < 0 || p > pos0 + tk)
                    throw InvalidArgument("[mla_attention] a selected position is not causal");
            }
        }
        selection = MlaSelection{positions->data(), count->data(), positions->shape(1)};
    }
    run_on_pool(threads, [&](cpu::ThreadPool& pool) {
        cpu::mla_attention(pool, q_abs.data(), n_head * key_width, cpu::KvRows{latent.data(), row, t},
                           n_tokens, pos0, shape, dst, n_head * n_lora_kv, i,
                           positions ? &selection : nullptr);
    });
    return out;
}

// q: [n_tokens, n_head * head_dim] f32, w: [n_tokens, n_head] f32; rows: [n_kv, row_bytes] uint8 KV rows
// (kv_store_row of [latent | indexer key], width elements) whose indexer key starts at key_offset.
py::tuple lightning_indexer_py(const FloatArray& q, const FloatArray& w, const ByteArray& rows,
                               const std::string& type, int64_t width, int64_t key_offset, int64_t pos0,
                               int64_t n_head, int64_t head_dim, int64_t top_k, float weight_scale,
                               int threads, const std::string& isa) {
    if (n_head <= 0 || head_dim <= 0 || top_k <= 0 || key_offset < 0 || key_offset + head_dim > width) {
        throw InvalidArgument("[lightning_indexer] bad shape");
    }
    if (q.ndim() != 2 || q.shape(1) != n_head * head_dim || w.ndim() != 2 || w.shape(0) != q.shape(0) ||
        w.shape(1) != n_head) {
        throw InvalidArgument(
            "[lightning_indexer] q must be [n_tokens, n_head * head_dim], w [n_tokens, n_head]");
    }
    const int64_t n_tokens = q.shape(0);
    const GgmlType t = parse_kv_type(type);
    const size_t row = ggml_row_size(t, width);
    check_stored_rows(rows, row, pos0 + n_tokens, "[lightning_indexer] rows");
    const IndexerShape shape{n_head, head_dim, key_offset, top_k, weight_scale};
    IntArray positions({n_tokens, top_k}), count({n_tokens});
    std::fill(positions.mutable_data(), positions.mutable_data() + n_tokens * top_k, -1);
    run_on_pool(threads, [&](cpu::ThreadPool& pool) {
        cpu::lightning_indexer(pool, q.data(), q.shape(1), w.data(), n_head, cpu::KvRows{rows.data(), row, t},
                               n_tokens, pos0, shape, positions.mutable_data(), count.mutable_data(),
                               isa_arg(isa));
    });
    return py::make_tuple(positions, count);
}

// The plan a streaming Session with these options would make (the file is only mapped).
py::dict memory_plan_py(const std::string& path, int n_ctx, const std::string& cache_type_k,
                        const std::string& cache_type_v, bool exact, int n_staging, bool allow_long_context) {
    const std::unique_ptr<Model> model = load_model(path, /*streaming=*/false);
    const HParams& h = model->hp;
    MemoryPlanRequest r;
    r.n_ctx = n_ctx > 0 ? n_ctx : std::min<int64_t>(h.n_ctx_train, 4096);
    check_context_size(r.n_ctx, h.n_ctx_train, allow_long_context, path);
    r.type_k = kv_type_for(cache_type_k, exact);
    r.type_v = kv_type_for(cache_type_v, exact);
    r.n_staging = static_cast<uint64_t>(std::max(0, n_staging));
    const MemoryPlan p = plan_memory(*model, r);
    py::dict d;
    d["n_ctx"] = r.n_ctx;
    d["cache_type_k"] = ggml_type_traits(r.type_k).name;
    d["cache_type_v"] = ggml_type_traits(r.type_v).name;
    d["latent_kv"] = p.latent_kv;
    d["dense_bytes"] = p.dense_bytes;
    d["kv_bytes"] = p.kv_bytes;
    d["buffer_bytes"] = p.buffer_bytes;
    d["fixed_bytes"] = p.fixed_bytes;
    d["slot_bytes"] = p.slot_bytes;
    d["n_min_slots"] = p.n_min_slots;
    d["minimum_bytes"] = p.minimum_bytes;
    d["summary"] = p.describe(r.n_ctx, r.type_k, r.type_v);
    return d;
}

}  // namespace

void bind_kv(py::module_& m) {
    m.def("kv_store_row", &kv_store_row_py, py::arg("type"), py::arg("x"),
          "One K/V row rounded to a cache type (f32, f16, q8_0, q4_0) exactly as the KV cache stores it");
    m.def("attention", &attention_py, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("type_k"),
          py::arg("type_v"), py::arg("pos0"), py::arg("n_head"), py::arg("n_head_kv"), py::arg("head_dim"),
          py::arg("scale"), py::arg("threads") = 1, py::arg("isa") = "", py::arg("window") = 0,
          py::arg("sinks") = py::none(), py::arg("exact") = false, py::arg("chunk") = 0,
          "Causal attention of q's rows (positions pos0..) over stored K/V rows (cpu/ops/attention.h); "
          "window > 0: sliding window; sinks: [n_head] sink logits; exact: exact mode's arithmetic; "
          "chunk > 0: chunked local attention (llama4)");
    m.def("attention_block_kernels", &attention_block_kernels_py, py::arg("isa"), py::arg("q"), py::arg("k"),
          py::arg("v"), py::arg("lo"), py::arg("hi"), py::arg("scale"),
          "Fast mode's block kernels of one ISA on one block (cpu/ops/attention_kernels.h), for tests: "
          "q [rows, head_dim], k / v [keys, head_dim] f32; row r reads keys [lo[r], hi[r]); returns "
          "(m [rows], l [rows], o [rows, head_dim]) of the unnormalised partial softmax");
    m.def("mla_attention", &mla_attention_py, py::arg("q_abs"), py::arg("latent"), py::arg("type"),
          py::arg("pos0"), py::arg("n_head"), py::arg("n_lora_kv"), py::arg("n_rot"), py::arg("scale"),
          py::arg("threads") = 1, py::arg("isa") = "", py::arg("positions") = py::none(),
          py::arg("count") = py::none(),
          "deepseek2's absorbed-form latent attention of q_abs's rows (positions pos0..) over stored latent "
          "rows (cpu/ops/mla_attention.h); positions [n_tokens, k] / count [n_tokens]: each row attends only "
          "to its count[t] positions (DSA's selection, ascending)");
    m.def("lightning_indexer", &lightning_indexer_py, py::arg("q"), py::arg("w"), py::arg("rows"),
          py::arg("type"), py::arg("width"), py::arg("key_offset"), py::arg("pos0"), py::arg("n_head"),
          py::arg("head_dim"), py::arg("top_k"), py::arg("weight_scale"), py::arg("threads") = 1,
          py::arg("isa") = "",
          "DSA's lightning indexer (cpu/ops/lightning_indexer.h): each row's (positions [n_tokens, top_k] "
          "ascending, -1 past count; count [n_tokens]) over the indexer keys stored in rows");
    m.def("memory_plan", &memory_plan_py, py::arg("path"), py::arg("n_ctx") = 0, py::arg("cache_type_k") = "",
          py::arg("cache_type_v") = "", py::arg("exact") = false, py::arg("n_staging") = 0,
          py::arg("allow_long_context") = false,
          "The RAM budget plan of a streaming session (memory_plan.h): bytes of each part and the minimum");
}

}  // namespace sharpi::py_bindings
