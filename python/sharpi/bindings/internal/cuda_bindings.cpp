// The CUDA backend's host-testable parts: device info, the shared block math
// (cuda/block_math.cuh through cuda/block_math_host.h) and the device forward pass's plan. Present in every
// build, CUDA or not. Type conversion only.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "backend/cuda_interface.h"
#include "backend/op_trace.h"
#include "block_math_host.h"
#include "device_plan.h"
#include "internal.h"
#include "model/kv_cache.h"
#include "model/model.h"
#include "sharpi/errors.h"

namespace py = pybind11;

namespace sharpi::py_bindings {
namespace {

using ByteArray = py::array_t<uint8_t, py::array::c_style | py::array::forcecast>;
using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;

GgmlType type_arg(int type) {
    return static_cast<GgmlType>(static_cast<uint32_t>(type));
}

template <typename Array>
void check_size(const Array& a, int64_t expected, const char* what) {
    if (static_cast<int64_t>(a.size()) != expected || expected < 0) {
        throw InvalidArgument(std::string("[cuda] ") + what + " has " + std::to_string(a.size()) +
                              " elements, expected " + std::to_string(expected));
    }
}

template <typename T>
py::array_t<T> to_array(const std::vector<T>& v) {
    py::array_t<T> out(static_cast<py::ssize_t>(v.size()));
    if (!v.empty()) std::memcpy(out.mutable_data(), v.data(), v.size() * sizeof(T));
    return out;
}

py::array_t<float> dequantize(int type, const ByteArray& data) {
    std::vector<float> out;
    {
        py::gil_scoped_release release;
        out = cuda::host_dequantize(type_arg(type), data.data(), static_cast<size_t>(data.size()));
    }
    return to_array(out);
}

py::array_t<uint8_t> quantize_act(int weight_type, const FloatArray& x) {
    return to_array(cuda::host_quantize_act(type_arg(weight_type), x.data(), static_cast<int64_t>(x.size())));
}

py::array_t<float> dot_q8_blocks(int weight_type, const ByteArray& w, const ByteArray& xq) {
    return to_array(cuda::host_dot_q8_blocks(type_arg(weight_type), w.data(), static_cast<size_t>(w.size()),
                                             xq.data(), static_cast<size_t>(xq.size())));
}

py::dict device_info() {
    const cuda::DeviceInfo info = cuda::device_info();
    py::dict d;
    d["present"] = info.present;
    d["name"] = info.name;
    d["compute_capability"] = py::make_tuple(info.cc_major, info.cc_minor);
    d["vram_total"] = info.vram_total;
    d["vram_free"] = info.vram_free;
    d["vram_used"] = info.vram_total - info.vram_free;
    return d;
}

using IntArray = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

py::array_t<float> op_matmul(int type, const ByteArray& w, int64_t n_rows, int64_t n_cols,
                             const FloatArray& x, int64_t n_tokens, bool int8, bool tiled) {
    check_size(x, n_cols * n_tokens, "x");
    return to_array(cuda::op_matmul(type_arg(type), w.data(), static_cast<size_t>(w.size()), n_rows, n_cols,
                                    x.data(), n_tokens, int8, tiled));
}

py::array_t<float> op_expert_ffn(int gate_type, const ByteArray& gate, int up_type, const ByteArray& up,
                                 int down_type, const ByteArray& down, int64_t n_embd, int64_t n_ff,
                                 int64_t n_expert, const FloatArray& x, const IntArray& ids,
                                 const FloatArray& weights, bool int8, bool grouped,
                                 const std::string& activation, float limit,
                                 const std::optional<FloatArray>& gate_b,
                                 const std::optional<FloatArray>& up_b,
                                 const std::optional<FloatArray>& down_b) {
    const int64_t n_tokens = n_embd > 0 ? static_cast<int64_t>(x.size()) / n_embd : 0;
    check_size(x, n_tokens * n_embd, "x");
    const int64_t k = n_tokens > 0 ? static_cast<int64_t>(ids.size()) / n_tokens : 0;
    check_size(ids, n_tokens * k, "ids");
    check_size(weights, n_tokens * k, "weights");
    cuda::OpExperts e{gate.data(),
                      static_cast<size_t>(gate.size()),
                      up.data(),
                      static_cast<size_t>(up.size()),
                      down.data(),
                      static_cast<size_t>(down.size()),
                      type_arg(gate_type),
                      type_arg(up_type),
                      type_arg(down_type),
                      n_embd,
                      n_ff,
                      n_expert};
    // activation: "swiglu", "swiglu_oai" (gpt-oss, limit), "swiglu_clamped" (DeepSeek-V4, limit), "relu_sqr".
    if (activation == "relu_sqr") {
        e.relu_sqr = true;
    } else if (activation == "swiglu_clamped") {
        e.swiglu_clamp = limit;
    } else if (activation == "swiglu_oai") {
        e.swiglu_limit = limit;
    } else if (activation != "swiglu") {
        throw InvalidArgument("activation must be swiglu, swiglu_oai, swiglu_clamped or relu_sqr, got '" +
                              activation + "'");
    }
    if (gate_b) check_size(*gate_b, n_expert * n_ff, "gate_b");
    if (up_b) check_size(*up_b, n_expert * n_ff, "up_b");
    if (down_b) check_size(*down_b, n_expert * n_embd, "down_b");
    e.gate_b = gate_b ? gate_b->data() : nullptr;
    e.up_b = up_b ? up_b->data() : nullptr;
    e.down_b = down_b ? down_b->data() : nullptr;
    return to_array(cuda::op_expert_ffn(e, x.data(), n_tokens, ids.data(), weights.data(), k, int8, grouped));
}

}  // namespace

// plan_device_model on a freshly loaded (mapped) model, as a dict; cache types by their llama.cpp
// names ("" = f32, the device's own).
py::dict device_plan(const std::string& path, int64_t n_ctx, int64_t max_batch,
                     const std::string& cache_type_k, const std::string& cache_type_v) {
    const std::unique_ptr<Model> model = load_model(path, /*streaming=*/false);
    if (n_ctx < 0)
        throw InvalidArgument("cuda_device_plan: n_ctx must be >= 0, got " + std::to_string(n_ctx));
    if (n_ctx == 0) n_ctx = std::min<int64_t>(model->hp.n_ctx_train, 4096);  // a Session's default
    const GgmlType type_k = cache_type_k.empty() ? GgmlType::F32 : parse_kv_type(cache_type_k);
    const GgmlType type_v = cache_type_v.empty() ? GgmlType::F32 : parse_kv_type(cache_type_v);
    const cuda::DevicePlan plan = cuda::plan_device_model(*model, n_ctx, max_batch, type_k, type_v);
    py::list uploads;
    for (const cuda::DeviceUpload& u : plan.uploads) {
        uploads.append(py::make_tuple(u.name, static_cast<int>(u.type), u.bytes, u.expert));
    }
    py::dict d;
    d["arch"] = plan.arch;
    d["uploads"] = uploads;
    d["dense_bytes"] = plan.dense_bytes;
    d["expert_bytes"] = plan.expert_bytes;
    d["kv_bytes"] = plan.kv_bytes;
    d["buffer_bytes"] = plan.buffer_bytes;
    d["total_bytes"] = plan.total_bytes();
    d["n_ff_dense"] = plan.n_ff_dense;
    d["n_ctx"] = plan.n_ctx;
    return d;
}

// op_vram_tier_run on a freshly mapped model: returns ([[bytes per expert] per step], the cache's stats
// as Session.expert_stats() gives them).
py::tuple vram_tier_run(const std::string& path, uint64_t n_slots, uint64_t n_staging,
                        const std::string& policy, const std::vector<cuda::TierStep>& steps,
                        const std::string& reader) {
    const std::unique_ptr<Model> model = load_model(path, /*streaming=*/false);
    cuda::VramTierRun run;
    {
        py::gil_scoped_release release;
        run =
            cuda::op_vram_tier_run(*model, cuda::VramTierOptions{n_slots, n_staging, policy, reader}, steps);
    }
    py::list bytes;
    for (const auto& step : run.bytes) {
        py::list per;
        for (const std::string& b : step) per.append(py::bytes(b));
        bytes.append(per);
    }
    return py::make_tuple(bytes, stats_dict(run.stats));
}

void bind_cuda(py::module_& m) {
    py::class_<cuda::TierStep>(m, "CudaTierStep")
        .def(py::init([](int32_t layer, std::vector<int32_t> experts,
                         std::vector<std::pair<int32_t, int32_t>> prefetch_after) {
                 return cuda::TierStep{layer, std::move(experts), std::move(prefetch_after)};
             }),
             py::arg("layer"), py::arg("experts"),
             py::arg("prefetch_after") = std::vector<std::pair<int32_t, int32_t>>{});
    m.def(
        "cuda_vram_tier_run", &vram_tier_run, py::arg("path"), py::arg("n_slots"), py::arg("n_staging") = 0,
        py::arg("policy") = "slru", py::arg("steps") = std::vector<cuda::TierStep>{},
        py::arg("reader") = "auto",
        "The VRAM tier of the expert cache driven over `steps` (CudaTierStep list) with the fill source "
        "`reader` names (auto, cufile, ...): (bytes read back from each acquired slot per step, expert_stats "
        "dict); a typed error without a device");
    m.def("cuda_device_plan", &device_plan, py::arg("path"), py::arg("n_ctx") = 0, py::arg("max_batch") = 256,
          py::arg("cache_type_k") = "", py::arg("cache_type_v") = "",
          "What device=\"cuda\" would upload and allocate for the model (no device touched; n_ctx 0: a "
          "Session's default); "
          "UnsupportedError for what the device path does not compute");
    m.def("cuda_available", &cuda::available, "True when built with CUDA and a device is usable");
    m.def("cuda_describe", &cuda::describe,
          "One line: the CUDA device, VRAM total / used / free, or why none");
    m.def("cuda_device_info", &device_info,
          "dict(present, name, compute_capability, vram_total, vram_used, vram_free) of device 0");
    m.def("cuda_block_math_dequantize", &dequantize, py::arg("type"), py::arg("data"),
          "Whole blocks of `type` -> f32 through cuda/block_math.cuh's bm_dequant, compiled for the host");
    m.def("cuda_block_math_quantize_act", &quantize_act, py::arg("weight_type"), py::arg("x"),
          "x quantized to the q8 activation blocks the device's int8 path pairs with weight_type");
    m.def("cuda_block_math_dot_q8", &dot_q8_blocks, py::arg("weight_type"), py::arg("w"), py::arg("xq"),
          "One f32 partial per block: bm_dot_q8(weight block, activation block)");

    // The one forward pass's op sequence (backend/op_trace.h) and the CUDA backend's verdict on each
    // call (backend/cuda_interface.h unsupported_op): the host test of which architectures the device runs.
    m.def(
        "record_forward_ops",
        [](const std::string& path, const std::vector<token_t>& tokens, bool exact) {
            py::list out;
            for (const OpCall& c : record_forward_ops(path, tokens, exact)) {
                out.append(py::make_tuple(c.op, static_cast<int>(c.type), c.variant));
            }
            return out;
        },
        py::arg("path"), py::arg("tokens"), py::arg("exact") = false);
    m.def(
        "forward_logits",
        [](const std::string& path, const std::vector<token_t>& tokens, const std::string& backend,
           bool exact, int64_t batch, const std::string& cache_type) {
            std::vector<float> logits;
            {
                py::gil_scoped_release release;
                logits = forward_logits(path, tokens, backend, exact, batch, cache_type);
            }
            const int64_t n = static_cast<int64_t>(tokens.size());
            py::array_t<float> out = to_array(logits);
            return out.reshape({n, n > 0 ? static_cast<int64_t>(logits.size()) / n : int64_t{0}});
        },
        py::arg("path"), py::arg("tokens"), py::arg("backend") = "cpu", py::arg("exact") = true,
        py::arg("batch") = 0, py::arg("cache_type") = "",
        "Every token's logits [n, n_vocab] of `tokens` run through the layer builders on `backend` ('cpu' or "
        "'cuda') in batches of `batch` tokens (0: one prefill batch; 1: token by token), the KV cache of "
        "`cache_type` ('': the session default, f32 exact / f16 fast)");
    m.def(
        "cuda_weights_not_uploaded",
        [](const std::string& path, const std::vector<token_t>& tokens, bool exact) {
            const std::unique_ptr<Model> model = load_model(path);
            std::vector<std::pair<const uint8_t*, const uint8_t*>> uploads;
            for (const cuda::HostWeight& w : cuda::device_weights(*model)) {
                const auto* begin = static_cast<const uint8_t*>(w.data);
                uploads.emplace_back(begin, begin + w.bytes);
            }
            std::vector<std::string> missing;
            for (const WeightRead& r : record_weight_reads(*model, tokens, exact)) {
                const auto* p = static_cast<const uint8_t*>(r.data);
                const bool found = std::any_of(uploads.begin(), uploads.end(),
                                               [&](const auto& u) { return p >= u.first && p < u.second; });
                if (!found) missing.push_back(r.op);
            }
            return missing;
        },
        py::arg("path"), py::arg("tokens"), py::arg("exact") = true,
        "The ops of the recorded forward pass that name a weight outside device_weights() (what the CUDA "
        "backend uploads): empty when the device finds every weight the builders read");
    m.def(
        "cuda_unsupported_op",
        [](const std::string& op, int type, const std::string& variant) {
            return cuda::unsupported_op(OpCall{op, type_arg(type), variant});
        },
        py::arg("op"), py::arg("type"), py::arg("variant") = "");
    m.def("cuda_implemented_ops", &cuda::implemented_ops);

    // Device ops (backend/cuda_interface.h op entries): a typed error without CUDA or a device.
    m.def(
        "cuda_op_dequantize",
        [](int type, const ByteArray& data) {
            return to_array(
                cuda::op_dequantize(type_arg(type), data.data(), static_cast<size_t>(data.size())));
        },
        py::arg("type"), py::arg("data"));
    m.def(
        "cuda_op_quantize_act",
        [](int type, const FloatArray& x, int64_t n_tokens) {
            const int64_t n_cols = n_tokens > 0 ? static_cast<int64_t>(x.size()) / n_tokens : 0;
            check_size(x, n_cols * n_tokens, "x");
            return to_array(cuda::op_quantize_act(type_arg(type), x.data(), n_cols, n_tokens));
        },
        py::arg("weight_type"), py::arg("x"), py::arg("n_tokens") = 1);
    m.def("cuda_op_matmul", &op_matmul, py::arg("type"), py::arg("w"), py::arg("n_rows"), py::arg("n_cols"),
          py::arg("x"), py::arg("n_tokens") = 1, py::arg("int8") = false, py::arg("tiled") = false);
    m.def(
        "cuda_op_rms_norm",
        [](const FloatArray& x, const FloatArray& w, float eps) {
            const int64_t n = static_cast<int64_t>(w.size());
            const int64_t n_tokens = n > 0 ? static_cast<int64_t>(x.size()) / n : 0;
            check_size(x, n * n_tokens, "x");
            return to_array(cuda::op_rms_norm(x.data(), w.data(), n_tokens, n, eps));
        },
        py::arg("x"), py::arg("weight"), py::arg("eps"));
    m.def(
        "cuda_op_rope",
        [](const FloatArray& x, int64_t n_tokens, int64_t n_heads, int64_t head_dim, int64_t pos0,
           int64_t n_rot, bool neox, float freq_base, float freq_scale, float ext_factor, float corr_low,
           float corr_high, float mscale, const std::optional<FloatArray>& freq_factors) {
            check_size(x, n_tokens * n_heads * head_dim, "x");
            RopeParams p;
            p.freq_base = freq_base;
            p.freq_scale = freq_scale;
            p.ext_factor = ext_factor;
            p.corr_low = corr_low;
            p.corr_high = corr_high;
            p.mscale = mscale;
            if (freq_factors) {
                check_size(*freq_factors, n_rot / 2, "freq_factors");
                p.freq_factors = freq_factors->data();
            }
            return to_array(cuda::op_rope(x.data(), n_tokens, n_heads, head_dim, pos0, n_rot, neox, p));
        },
        py::arg("x"), py::arg("n_tokens"), py::arg("n_heads"), py::arg("head_dim"), py::arg("pos0"),
        py::arg("n_rot"), py::arg("neox"), py::arg("freq_base"), py::arg("freq_scale") = 1.0f,
        py::arg("ext_factor") = 0.0f, py::arg("corr_low") = 0.0f, py::arg("corr_high") = 0.0f,
        py::arg("mscale") = 1.0f, py::arg("freq_factors") = py::none());
    m.def(
        "cuda_op_silu_mul",
        [](const FloatArray& gate, const FloatArray& up) {
            check_size(up, static_cast<int64_t>(gate.size()), "up");
            return to_array(cuda::op_silu_mul(gate.data(), up.data(), static_cast<int64_t>(gate.size())));
        },
        py::arg("gate"), py::arg("up"));
    m.def(
        "cuda_op_router",
        [](const FloatArray& logits, int64_t n_expert, int64_t k, bool normalize, const std::string& gating,
           float scale, const std::optional<FloatArray>& selection_bias, bool rank_logits) {
            const int64_t n_tokens = n_expert > 0 ? static_cast<int64_t>(logits.size()) / n_expert : 0;
            check_size(logits, n_tokens * n_expert, "logits");
            RouterParams params;
            if (gating == "sigmoid") {
                params.gating = Gating::sigmoid;
            } else if (gating == "sqrt_softplus") {
                params.gating = Gating::sqrt_softplus;
            } else if (gating != "softmax") {
                throw InvalidArgument("gating must be softmax, sigmoid or sqrt_softplus, got '" + gating +
                                      "'");
            }
            params.normalize_topk = normalize;
            params.weights_scale = scale;
            if (selection_bias) {
                check_size(*selection_bias, n_expert, "selection_bias");
                params.selection_bias = selection_bias->data();
            }
            params.rank_logits = rank_logits;
            return to_array(cuda::op_router(logits.data(), n_tokens, n_expert, k, params));
        },
        py::arg("logits"), py::arg("n_expert"), py::arg("k"), py::arg("normalize"),
        py::arg("gating") = "softmax", py::arg("scale") = 1.0f, py::arg("selection_bias") = py::none(),
        py::arg("rank_logits") = false);
    m.def(
        "cuda_op_attention",
        [](const FloatArray& q, const FloatArray& k_cache, const FloatArray& v_cache, int64_t n_tokens,
           int64_t pos0, int64_t n_head, int64_t n_head_kv, int64_t head_dim, float scale, int64_t window,
           int64_t chunk, const std::optional<FloatArray>& sinks) {
            check_size(q, n_tokens * n_head * head_dim, "q");
            check_size(k_cache, (pos0 + n_tokens) * n_head_kv * head_dim, "k_cache");
            check_size(v_cache, (pos0 + n_tokens) * n_head_kv * head_dim, "v_cache");
            if (sinks) check_size(*sinks, n_head, "sinks");
            return to_array(cuda::op_attention(q.data(), k_cache.data(), v_cache.data(), n_tokens, pos0,
                                               n_head, n_head_kv, head_dim, scale, window, chunk,
                                               sinks ? sinks->data() : nullptr));
        },
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("n_tokens"), py::arg("pos0"),
        py::arg("n_head"), py::arg("n_head_kv"), py::arg("head_dim"), py::arg("scale"), py::arg("window") = 0,
        py::arg("chunk") = 0, py::arg("sinks") = py::none());
    m.def("cuda_op_expert_ffn", &op_expert_ffn, py::arg("gate_type"), py::arg("gate"), py::arg("up_type"),
          py::arg("up"), py::arg("down_type"), py::arg("down"), py::arg("n_embd"), py::arg("n_ff"),
          py::arg("n_expert"), py::arg("x"), py::arg("ids"), py::arg("weights"), py::arg("int8") = false,
          py::arg("grouped") = false, py::arg("activation") = "swiglu", py::arg("limit") = 0.0f,
          py::arg("gate_b") = py::none(), py::arg("up_b") = py::none(), py::arg("down_b") = py::none());
}

}  // namespace sharpi::py_bindings
