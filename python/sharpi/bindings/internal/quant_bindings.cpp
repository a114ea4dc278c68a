// Quant kernels for tests and benchmarks: dequantize / dot one row with a chosen ISA, and the
// matmul op. Type conversion and size checks only; the kernels live in cpu/quant and cpu/ops.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/ops/activation.h"
#include "cpu/ops/expert_ffn.h"
#include "cpu/ops/matmul.h"
#include "cpu/quant/kernels.h"
#include "cpu/quant/qdot.h"
#include "internal.h"
#include "quant/ggml_type.h"
#include "sharpi/errors.h"
#include "threads/thread_pool.h"

namespace py = pybind11;

namespace sharpi::py_bindings {

cpu::Isa isa_arg(const std::string& name) {
    if (name.empty()) return cpu::active_isa();
    cpu::Isa isa;
    if (!cpu::parse_isa_name(name.c_str(), &isa)) {
        throw InvalidArgument("[quant] unknown isa '" + name + "': expected scalar, avx2 or avx512");
    }
    if (static_cast<int>(isa) > static_cast<int>(cpu::detect_isa())) {
        throw InvalidArgument("[quant] isa " + name + " is not available on this CPU (best: " +
                              cpu::isa_name(cpu::detect_isa()) + ")");
    }
    return isa;
}

namespace {

using ByteArray = py::array_t<uint8_t, py::array::c_style>;
using FloatArray = py::array_t<float, py::array::c_style>;

GgmlType type_arg(int type) {
    return static_cast<GgmlType>(static_cast<uint32_t>(type));
}

// Bytes of a row of n elements of `type`; the kernels for the type must exist (checked before).
size_t checked_row_bytes(GgmlType type, int64_t n) {
    const GgmlTypeTraits& traits = ggml_type_traits(type);
    if (n < 0 || n % traits.block_size != 0) {
        throw InvalidArgument("[quant] n=" + std::to_string(n) + " is not a non-negative multiple of " +
                              traits.name + "'s block size " + std::to_string(traits.block_size));
    }
    return ggml_row_size(type, n);
}

void check_data_size(const ByteArray& data, size_t expected, GgmlType type, const std::string& what) {
    if (data.ndim() != 1 || static_cast<size_t>(data.size()) != expected) {
        throw InvalidArgument("[quant] data has " + std::to_string(data.size()) + " bytes in " +
                              std::to_string(data.ndim()) + " dims; " + what + " of " +
                              ggml_type_traits(type).name + " needs a 1-D array of " +
                              std::to_string(expected));
    }
}

FloatArray dequantize(int type_id, const ByteArray& data, int64_t n, const std::string& isa) {
    const GgmlType type = type_arg(type_id);
    const cpu::RowKernels& kernels = cpu::row_kernels(type, isa_arg(isa));
    check_data_size(data, checked_row_bytes(type, n), type, "a row of n=" + std::to_string(n));
    FloatArray out(static_cast<py::ssize_t>(n));
    const uint8_t* src = data.data();
    float* dst = out.mutable_data();
    {
        py::gil_scoped_release release;
        kernels.dequant_row(src, dst, n);
    }
    return out;
}

float dot(int type_id, const ByteArray& data, const FloatArray& x, const std::string& isa) {
    const GgmlType type = type_arg(type_id);
    const cpu::RowKernels& kernels = cpu::row_kernels(type, isa_arg(isa));
    if (x.ndim() != 1)
        throw InvalidArgument("[quant] dot: x must be 1-D, got " + std::to_string(x.ndim()) + " dims");
    const int64_t n = x.shape(0);
    check_data_size(data, checked_row_bytes(type, n), type, "a row of n=" + std::to_string(n));
    const uint8_t* src = data.data();
    const float* xp = x.data();
    py::gil_scoped_release release;
    return kernels.dot_row(src, xp, n);
}

// One pool per thread count, kept for the process: benchmarks call matmul in a loop and must not
// time thread creation. The mutex serializes callers (a pool is not reentrant).
std::mutex pools_mutex;
std::map<int, std::unique_ptr<cpu::ThreadPool>> pools;

// The cached pool of `threads` threads; call with pools_mutex held.
cpu::ThreadPool& pool_of(int threads) {
    std::unique_ptr<cpu::ThreadPool>& pool = pools[threads];
    if (!pool) pool = std::make_unique<cpu::ThreadPool>(threads);
    return *pool;
}

FloatArray matmul(int type_id, const ByteArray& data, int64_t n_rows, int64_t n_cols, const FloatArray& x,
                  int threads, bool exact) {
    const GgmlType type = type_arg(type_id);
    cpu::row_kernels(type);  // UnsupportedError before any size message
    if (n_rows < 0)
        throw InvalidArgument("[quant] matmul: n_rows=" + std::to_string(n_rows) + " is negative");
    const size_t row_bytes = checked_row_bytes(type, n_cols);
    check_data_size(data, row_bytes * static_cast<size_t>(n_rows), type,
                    "a [" + std::to_string(n_rows) + ", " + std::to_string(n_cols) + "] matrix");
    if (x.ndim() != 2 || x.shape(1) != n_cols) {
        std::string shape;
        for (py::ssize_t i = 0; i < x.ndim(); ++i) shape += (i ? ", " : "") + std::to_string(x.shape(i));
        throw InvalidArgument("[quant] matmul: x must be [T, " + std::to_string(n_cols) + "] float32, got [" +
                              shape + "]");
    }
    if (threads < 1 || threads > 1024) {
        throw InvalidArgument("[quant] matmul: threads must be in [1, 1024], got " + std::to_string(threads));
    }
    const int64_t n_tokens = x.shape(0);
    FloatArray y({static_cast<py::ssize_t>(n_tokens), static_cast<py::ssize_t>(n_rows)});
    cpu::WeightView w;
    w.type = type;
    w.data = data.data();
    w.n_rows = n_rows;
    w.n_cols = n_cols;
    w.row_bytes = row_bytes;
    const float* xp = x.data();
    float* yp = y.mutable_data();
    {
        py::gil_scoped_release release;
        std::lock_guard<std::mutex> lock(pools_mutex);
        cpu::matmul(pool_of(threads), w, xp, n_cols, n_tokens, yp, n_rows, exact);
    }
    return y;
}

// ---- fast-mode kernels (cpu/quant/qdot.h) ----

cpu::ActFormat format_arg(const std::string& name) {
    for (cpu::ActFormat f : {cpu::ActFormat::q8_0, cpu::ActFormat::q8_1, cpu::ActFormat::q8_K}) {
        if (name == cpu::act_format_name(f)) return f;
    }
    throw InvalidArgument("[quant] unknown activation format '" + name + "': expected q8_0, q8_1 or q8_K");
}

const cpu::QuantDotKernels& quant_dot_arg(GgmlType type, cpu::Isa isa) {
    cpu::row_kernels(type, isa);  // UnsupportedError for types sharpi cannot compute at all
    const cpu::QuantDotKernels* k = cpu::quant_dot_kernels(type, isa);
    if (k == nullptr) {
        throw InvalidArgument(std::string("[quant] ") + ggml_type_traits(type).name +
                              " has no integer kernel (f32 activations in both modes)");
    }
    return *k;
}

ByteArray quantize_act(const std::string& format_name, const FloatArray& x, const std::string& isa) {
    const cpu::ActFormat format = format_arg(format_name);
    const cpu::QuantizeActFn quantize = cpu::quantize_act_kernel(format, isa_arg(isa));
    if (x.ndim() != 1 || x.shape(0) % cpu::act_block_size(format) != 0) {
        throw InvalidArgument("[quant] quantize_act: x must be 1-D with a multiple of " +
                              std::to_string(cpu::act_block_size(format)) + " elements");
    }
    const int64_t n = x.shape(0);
    ByteArray out(static_cast<py::ssize_t>(cpu::act_row_bytes(format, n)));
    const float* xp = x.data();
    uint8_t* dst = out.mutable_data();
    py::gil_scoped_release release;
    quantize(xp, dst, n);
    return out;
}

// n_tokens rows of quantized activations (act_row_bytes each, consecutive) . one weight row of n.
FloatArray vec_dot_tile(int type_id, const ByteArray& w, const ByteArray& xq, int64_t n, int n_tokens,
                        const std::string& isa) {
    const GgmlType type = type_arg(type_id);
    const cpu::Isa i = isa_arg(isa);
    const cpu::QuantDotKernels& k = quant_dot_arg(type, i);
    check_data_size(w, checked_row_bytes(type, n), type, "a row of n=" + std::to_string(n));
    if (n_tokens < 1 || n_tokens > cpu::kMaxTileTokens) {
        throw InvalidArgument("[quant] vec_dot_tile: n_tokens must be in [1, " +
                              std::to_string(cpu::kMaxTileTokens) + "], got " + std::to_string(n_tokens));
    }
    const size_t xq_bytes = cpu::act_row_bytes(cpu::act_format(type), n);
    if (xq.ndim() != 1 || static_cast<size_t>(xq.size()) != xq_bytes * static_cast<size_t>(n_tokens)) {
        throw InvalidArgument("[quant] vec_dot: xq has " + std::to_string(xq.size()) + " bytes; " +
                              std::to_string(n_tokens) + " rows of " +
                              cpu::act_format_name(cpu::act_format(type)) + " need " +
                              std::to_string(xq_bytes * static_cast<size_t>(n_tokens)));
    }
    FloatArray y(static_cast<py::ssize_t>(n_tokens));
    const uint8_t* wp = w.data();
    const uint8_t* xp = xq.data();
    float* yp = y.mutable_data();
    py::gil_scoped_release release;
    if (n_tokens == 1) {
        yp[0] = k.vec_dot(wp, xp, n);
    } else {
        k.vec_dot_tile(wp, xp, xq_bytes, n_tokens, n, yp, 1);
    }
    return y;
}

// experts: k tuples (gate_type, gate_bytes, up_type, up_bytes, down_type, down_bytes); gate/up are
// [n_ff, n_embd], down [n_embd, n_ff]. fused=True: cpu::expert_ffn_one_token; False: the unfused
// composition (a one-token matmul per projection, swiglu, weighted sum in slot order).
using ExpertTuple = std::tuple<int, ByteArray, int, ByteArray, int, ByteArray>;

// The experts' weight views ([n_ff, n_embd] gate/up, [n_embd, n_ff] down), validated.
std::vector<cpu::ExpertFfnWeights> expert_views(const std::vector<ExpertTuple>& experts, int64_t n_ff,
                                                int64_t n_embd) {
    auto view = [](int type_id, const ByteArray& data, int64_t n_rows, int64_t n_cols) {
        const GgmlType type = type_arg(type_id);
        cpu::row_kernels(type);
        cpu::WeightView v;
        v.type = type;
        v.n_rows = n_rows;
        v.n_cols = n_cols;
        v.row_bytes = checked_row_bytes(type, n_cols);
        check_data_size(data, v.row_bytes * static_cast<size_t>(n_rows), type, "an expert projection");
        v.data = data.data();
        return v;
    };
    std::vector<cpu::ExpertFfnWeights> w(experts.size());
    for (size_t j = 0; j < experts.size(); ++j) {
        const ExpertTuple& e = experts[j];
        w[j].gate = view(std::get<0>(e), std::get<1>(e), n_ff, n_embd);
        w[j].up = view(std::get<2>(e), std::get<3>(e), n_ff, n_embd);
        w[j].down = view(std::get<4>(e), std::get<5>(e), n_embd, n_ff);
    }
    return w;
}

FloatArray expert_ffn(const std::vector<ExpertTuple>& experts, const FloatArray& weights, const FloatArray& x,
                      int64_t n_ff, int threads, bool exact, bool fused) {
    const int k = static_cast<int>(experts.size());
    if (k < 1 || weights.ndim() != 1 || weights.shape(0) != k || x.ndim() != 1) {
        throw InvalidArgument("[quant] expert_ffn: need k >= 1 experts, weights[k] and a 1-D x");
    }
    if (threads < 1 || threads > 1024)
        throw InvalidArgument("[quant] expert_ffn: threads must be in [1, 1024]");
    const int64_t n_embd = x.shape(0);
    std::vector<cpu::ExpertFfnWeights> w = expert_views(experts, n_ff, n_embd);
    FloatArray out(static_cast<py::ssize_t>(n_embd));
    const float* xp = x.data();
    const float* wp = weights.data();
    float* op = out.mutable_data();
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(pools_mutex);
    cpu::ThreadPool* pool = &pool_of(threads);
    if (fused) {
        cpu::expert_ffn_one_token(*pool, w.data(), wp, k, xp, op, exact);
        return out;
    }
    std::vector<float> g(static_cast<size_t>(n_ff)), u(static_cast<size_t>(n_ff)),
        y(static_cast<size_t>(n_embd));
    for (int j = 0; j < k; ++j) {
        cpu::matmul(*pool, w[j].gate, xp, n_embd, 1, g.data(), n_ff, exact);
        cpu::matmul(*pool, w[j].up, xp, n_embd, 1, u.data(), n_ff, exact);
        cpu::swiglu(g.data(), u.data(), g.data(), n_ff);
        cpu::matmul(*pool, w[j].down, g.data(), n_ff, 1, y.data(), n_embd, exact);
        for (int64_t i = 0; i < n_embd; ++i) op[i] = j == 0 ? wp[0] * y[i] : op[i] + wp[j] * y[i];
    }
    return out;
}

// members[e]: the token rows of x ([T, n_embd]) expert e runs over; returns the unweighted outputs
// [sum of len(members[e]), n_embd], expert by expert in members order (cpu::expert_ffn_batch).
FloatArray expert_ffn_batch(const std::vector<ExpertTuple>& experts,
                            const std::vector<py::array_t<int64_t, py::array::c_style>>& members,
                            const FloatArray& x, int64_t n_ff, int threads, bool exact) {
    const int n_experts = static_cast<int>(experts.size());
    if (n_experts < 1 || members.size() != experts.size() || x.ndim() != 2) {
        throw InvalidArgument(
            "[quant] expert_ffn_batch: need experts, one token array per expert and a 2-D x");
    }
    if (threads < 1 || threads > 1024)
        throw InvalidArgument("[quant] expert_ffn_batch: threads must be in [1, 1024]");
    const int64_t n_tokens = x.shape(0), n_embd = x.shape(1);
    std::vector<cpu::ExpertFfnWeights> w = expert_views(experts, n_ff, n_embd);
    std::vector<int64_t> begin, end, tokens;
    for (const auto& m : members) {
        begin.push_back(static_cast<int64_t>(tokens.size()));
        for (py::ssize_t i = 0; i < m.size(); ++i) {
            const int64_t t = m.data()[i];
            if (t < 0 || t >= n_tokens)
                throw InvalidArgument("[quant] expert_ffn_batch: token index out of range");
            tokens.push_back(t);
        }
        end.push_back(static_cast<int64_t>(tokens.size()));
    }
    FloatArray y({static_cast<py::ssize_t>(tokens.size()), static_cast<py::ssize_t>(n_embd)});
    const float* xp = x.data();
    float* yp = y.mutable_data();
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(pools_mutex);
    cpu::expert_ffn_batch(pool_of(threads), w.data(), begin.data(), end.data(), n_experts, tokens.data(), xp,
                          n_embd, yp, n_embd, exact);
    return y;
}

std::vector<std::string> isa_available() {
    std::vector<std::string> names;
    for (int i = 0; i <= static_cast<int>(cpu::detect_isa()); ++i)
        names.push_back(cpu::isa_name(static_cast<cpu::Isa>(i)));
    return names;
}

}  // namespace

void bind_quant(py::module_& m) {
    m.def("isa_available", &isa_available, "ISAs this CPU can run, from scalar up to the best one");
    m.def(
        "active_isa", [] { return std::string(cpu::isa_name(cpu::active_isa())); },
        "The ISA the kernels use: the best available, lowered by SHARPI_ISA (fixed at first use)");
    m.def(
        "amx_available", [] { return cpu::amx_available(); },
        "Whether fast-mode prefill runs on AMX-INT8 tiles here (CPU, OS grant, SHARPI_AMX != 0; "
        "with the avx512 ISA active)");
    m.def("dequantize", &dequantize, py::arg("type"), py::arg("data"), py::arg("n"), py::arg("isa") = "",
          "Dequantize one row of n elements of GGML type `type` (raw bytes) to float32[n]");
    m.def("dot", &dot, py::arg("type"), py::arg("data"), py::arg("x"), py::arg("isa") = "",
          "dot_row: one quantized row (raw bytes) with float32 x[n]");
    m.def("matmul", &matmul, py::arg("type"), py::arg("data"), py::arg("n_rows"), py::arg("n_cols"),
          py::arg("x"), py::arg("threads") = 1, py::arg("exact") = false,
          "Y[T, n_rows] = X[T, n_cols] @ W.T for W given as n_rows quantized rows; active ISA, GIL released. "
          "exact=False: fast mode (X quantized per token for types with integer kernels)");
    m.def("expert_ffn", &expert_ffn, py::arg("experts"), py::arg("weights"), py::arg("x"), py::arg("n_ff"),
          py::arg("threads") = 1, py::arg("exact") = false, py::arg("fused") = true,
          "One token's routed-expert FFN: sum_j weights[j] * down_j(silu(gate_j x) * up_j x); experts = "
          "[(gate_type, gate_bytes, up_type, up_bytes, down_type, down_bytes)], fused or unfused");
    m.def(
        "expert_ffn_batch", &expert_ffn_batch, py::arg("experts"), py::arg("members"), py::arg("x"),
        py::arg("n_ff"), py::arg("threads") = 1, py::arg("exact") = false,
        "Prefill FFN of several experts over their own token rows of x[T, n_embd] (members[e]: indices): the "
        "unweighted outputs [sum len(members[e]), n_embd] in member order");
    m.def(
        "act_format",
        [](int type) { return std::string(cpu::act_format_name(cpu::act_format(type_arg(type)))); },
        py::arg("type"), "Activation format fast mode dots weight type `type` with: q8_0, q8_1, q8_K or f32");
    m.def("quantize_act", &quantize_act, py::arg("format"), py::arg("x"), py::arg("isa") = "",
          "Quantize float32 x[n] to activation blocks of `format` (q8_0, q8_1, q8_K): raw bytes");
    m.def("vec_dot_tile", &vec_dot_tile, py::arg("type"), py::arg("w"), py::arg("xq"), py::arg("n"),
          py::arg("n_tokens") = 1, py::arg("isa") = "",
          "Integer dot of one weight row with n_tokens quantized activation rows (vec_dot for 1, the "
          "tile kernel above): float32[n_tokens]");
}

}  // namespace sharpi::py_bindings
