// The op entries of backend/cuda_interface.h: upload, one op's launches on a fresh stream, wait, download.
// For the GPU tests (tests/test_cuda_gpu.py) and benchmarks; the forward pass calls the launch
// functions directly and never synchronizes per op.
#include <string>
#include <vector>

#include "backend/cuda_interface.h"
#include "device_memory.cuh"
#include "ops/activation.cuh"
#include "ops/attention.cuh"
#include "ops/dequantize.cuh"
#include "ops/expert_ffn.cuh"
#include "ops/matmul_q8.cuh"
#include "ops/matvec.cuh"
#include "ops/rms_norm.cuh"
#include "ops/rope.cuh"
#include "ops/router.cuh"

namespace sharpi::cuda {
namespace {

// A device copy of n_bytes host bytes.
DeviceBuffer upload(const void* src, size_t n_bytes, const Stream& stream, const std::string& what) {
    DeviceBuffer buf(n_bytes, what);
    if (n_bytes > 0) copy_to_device(buf.data(), src, n_bytes, stream, what);
    return buf;
}

template <typename T>
std::vector<T> download(const DeviceBuffer& buf, size_t count, const Stream& stream,
                        const std::string& what) {
    std::vector<T> out(count);
    if (count > 0) copy_to_host(out.data(), buf.data(), count * sizeof(T), stream, what);
    stream.synchronize(what);
    return out;
}

size_t checked_row_bytes(GgmlType type, int64_t n_cols, const char* what) {
    const GgmlTypeTraits& t = ggml_type_traits(type);
    if (t.block_size <= 0 || n_cols % t.block_size != 0) {
        throw InvalidArgument(std::string("[cuda] ") + what + ": n_cols=" + std::to_string(n_cols) +
                              " is not a multiple of " + t.name + "'s block size");
    }
    return ggml_row_size(type, n_cols);
}

}  // namespace

std::vector<float> op_dequantize(GgmlType type, const void* data, size_t n_bytes) {
    require_device("dequantize");
    const GgmlTypeTraits& t = ggml_type_traits(type);
    if (t.type_size == 0 || n_bytes % t.type_size != 0) {
        throw InvalidArgument("[cuda] dequantize: " + std::to_string(n_bytes) + " bytes is not whole " +
                              t.name + " blocks");
    }
    const int64_t n = static_cast<int64_t>(n_bytes / t.type_size) * t.block_size;
    Stream stream;
    DeviceBuffer src = upload(data, n_bytes, stream, "dequantize input");
    DeviceBuffer dst(sizeof(float) * n, "dequantize output");
    launch_dequantize(type, src.data(), dst.as<float>(), n, stream.get());
    return download<float>(dst, static_cast<size_t>(n), stream, "dequantize");
}

std::vector<uint8_t> op_quantize_act(GgmlType weight, const float* x, int64_t n_cols, int64_t n_tokens) {
    require_device("quantize_act");
    const size_t row = q8_act_row_bytes(weight, n_cols);
    Stream stream;
    DeviceBuffer xd = upload(x, sizeof(float) * n_cols * n_tokens, stream, "activations");
    DeviceBuffer xq(row * n_tokens, "quantized activations");
    launch_quantize_act(weight, xd.as<float>(), n_cols, n_tokens, xq.data(), stream.get());
    return download<uint8_t>(xq, row * n_tokens, stream, "quantize_act");
}

std::vector<float> op_matmul(GgmlType type, const void* w, size_t w_bytes, int64_t n_rows, int64_t n_cols,
                             const float* x, int64_t n_tokens, bool int8, bool tiled) {
    require_device("matmul");
    if (w_bytes != checked_row_bytes(type, n_cols, "matmul") * n_rows) {
        throw InvalidArgument("[cuda] matmul: " + std::to_string(w_bytes) + " weight bytes for " +
                              std::to_string(n_rows) + " rows of " + std::to_string(n_cols));
    }
    Stream stream;
    DeviceBuffer wd = upload(w, w_bytes, stream, "weights");
    DeviceBuffer xd = upload(x, sizeof(float) * n_cols * n_tokens, stream, "activations");
    DeviceBuffer y(sizeof(float) * n_rows * n_tokens, "matmul output");
    if (int8) {
        const size_t row = q8_act_row_bytes(type, n_cols);
        DeviceBuffer xq(row * n_tokens, "quantized activations");
        launch_quantize_act(type, xd.as<float>(), n_cols, n_tokens, xq.data(), stream.get());
        if (tiled) {
            launch_matmul_q8(type, wd.data(), n_rows, n_cols, xq.data(), n_tokens, y.as<float>(),
                             stream.get());
        } else {
            launch_matvec_q8(type, wd.data(), n_rows, n_cols, xq.data(), n_tokens, y.as<float>(),
                             stream.get());
        }
        return download<float>(y, static_cast<size_t>(n_rows * n_tokens), stream, "matmul");
    }
    launch_matvec_f32(type, wd.data(), n_rows, n_cols, xd.as<float>(), n_tokens, y.as<float>(), stream.get());
    return download<float>(y, static_cast<size_t>(n_rows * n_tokens), stream, "matmul");
}

std::vector<float> op_rms_norm(const float* x, const float* weight, int64_t n_tokens, int64_t n, float eps) {
    require_device("rms_norm");
    Stream stream;
    DeviceBuffer xd = upload(x, sizeof(float) * n * n_tokens, stream, "rms_norm input");
    DeviceBuffer wd = upload(weight, sizeof(float) * n, stream, "rms_norm weight");
    DeviceBuffer y(sizeof(float) * n * n_tokens, "rms_norm output");
    launch_rms_norm(xd.as<float>(), wd.as<float>(), n_tokens, n, eps, y.as<float>(), stream.get());
    return download<float>(y, static_cast<size_t>(n * n_tokens), stream, "rms_norm");
}

std::vector<float> op_rope(const float* x, int64_t n_tokens, int64_t n_heads, int64_t head_dim, int64_t pos0,
                           int64_t n_rot, bool neox, const RopeParams& p) {
    require_device("rope");
    const int64_t ld = n_heads * head_dim;
    Stream stream;
    DeviceBuffer xd = upload(x, sizeof(float) * ld * n_tokens, stream, "rope input");
    DeviceBuffer ff = upload(p.freq_factors, p.freq_factors ? sizeof(float) * (n_rot / 2) : 0, stream,
                             "rope frequency factors");
    RopeParams q = p;
    q.n_rot = n_rot;
    q.type = neox ? RopeType::neox : RopeType::normal;
    launch_rope(xd.as<float>(), ld, n_tokens, n_heads, head_dim, pos0,
                device_rope(q, p.freq_factors ? ff.as<float>() : nullptr), stream.get());
    return download<float>(xd, static_cast<size_t>(ld * n_tokens), stream, "rope");
}

std::vector<float> op_silu_mul(const float* gate, const float* up, int64_t n) {
    require_device("silu_mul");
    Stream stream;
    DeviceBuffer g = upload(gate, sizeof(float) * n, stream, "gate");
    DeviceBuffer u = upload(up, sizeof(float) * n, stream, "up");
    launch_silu_mul(g.as<float>(), u.as<float>(), n, g.as<float>(), stream.get());
    return download<float>(g, static_cast<size_t>(n), stream, "silu_mul");
}

std::vector<float> op_router(const float* logits, int64_t n_tokens, int64_t n_expert, int64_t k,
                             const RouterParams& params) {
    require_device("router");
    if (params.n_group > 1) throw UnsupportedError("[cuda] router: expert groups are not on the device");
    Stream stream;
    DeviceBuffer ld = upload(logits, sizeof(float) * n_tokens * n_expert, stream, "router logits");
    DeviceBuffer bias = upload(params.selection_bias, params.selection_bias ? sizeof(float) * n_expert : 0,
                               stream, "router selection bias");
    DeviceBuffer ids(sizeof(int32_t) * n_tokens * k, "router ids");
    DeviceBuffer weights(sizeof(float) * n_tokens * k, "router weights");
    DeviceRouterSpec spec;
    spec.gating = params.gating;
    spec.normalize = params.normalize_topk;
    spec.scale = params.weights_scale;
    spec.selection_bias = params.selection_bias ? bias.as<float>() : nullptr;
    spec.rank_logits = params.rank_logits;
    launch_router_topk(ld.as<float>(), n_tokens, n_expert, k, spec, ids.as<int32_t>(), weights.as<float>(),
                       stream.get());
    const std::vector<int32_t> id_host =
        download<int32_t>(ids, static_cast<size_t>(n_tokens * k), stream, "router");
    std::vector<float> out(id_host.begin(), id_host.end());
    const std::vector<float> w_host =
        download<float>(weights, static_cast<size_t>(n_tokens * k), stream, "router");
    out.insert(out.end(), w_host.begin(), w_host.end());
    return out;
}

std::vector<float> op_attention(const float* q, const float* k_cache, const float* v_cache, int64_t n_tokens,
                                int64_t pos0, int64_t n_head, int64_t n_head_kv, int64_t head_dim,
                                float scale, int64_t window, int64_t chunk, const float* sinks) {
    require_device("attention");
    const int64_t n_kv = pos0 + n_tokens, q_ld = n_head * head_dim, kv_ld = n_head_kv * head_dim;
    Stream stream;
    DeviceBuffer qd = upload(q, sizeof(float) * q_ld * n_tokens, stream, "q");
    DeviceBuffer kd = upload(k_cache, sizeof(float) * kv_ld * n_kv, stream, "k cache");
    DeviceBuffer vd = upload(v_cache, sizeof(float) * kv_ld * n_kv, stream, "v cache");
    DeviceBuffer sd = upload(sinks, sinks ? sizeof(float) * n_head : 0, stream, "sinks");
    DeviceBuffer out(sizeof(float) * q_ld * n_tokens, "attention output");
    DeviceAttentionLimits limits;
    limits.window = window;
    limits.chunk = chunk;
    limits.sinks = sinks ? sd.as<float>() : nullptr;
    launch_attention(qd.as<float>(), kd.as<float>(), vd.as<float>(), n_tokens, pos0, n_head, n_head_kv,
                     head_dim, scale, out.as<float>(), stream.get(), limits);
    return download<float>(out, static_cast<size_t>(q_ld * n_tokens), stream, "attention");
}

std::vector<float> op_expert_ffn(const OpExperts& e, const float* x, int64_t n_tokens, const int32_t* ids,
                                 const float* weights, int64_t k, bool int8, bool grouped) {
    require_device("expert_ffn");
    const size_t want_gate = checked_row_bytes(e.gate_type, e.n_embd, "expert gate") * e.n_ff * e.n_expert;
    const size_t want_up = checked_row_bytes(e.up_type, e.n_embd, "expert up") * e.n_ff * e.n_expert;
    const size_t want_down = checked_row_bytes(e.down_type, e.n_ff, "expert down") * e.n_embd * e.n_expert;
    if (e.gate_bytes != want_gate || e.up_bytes != want_up || e.down_bytes != want_down) {
        throw InvalidArgument(
            "[cuda] expert_ffn: expert tensors are not [n_expert, rows, cols] of their types");
    }
    for (int64_t i = 0; i < n_tokens * k; ++i) {
        if (ids[i] < 0 || ids[i] >= e.n_expert) {
            throw InvalidArgument("[cuda] expert_ffn: expert id " + std::to_string(ids[i]) + " out of range");
        }
    }
    Stream stream;
    DeviceBuffer gate = upload(e.gate, e.gate_bytes, stream, "expert gate");
    DeviceBuffer up = upload(e.up, e.up_bytes, stream, "expert up");
    DeviceBuffer down = upload(e.down, e.down_bytes, stream, "expert down");
    DeviceBuffer xd = upload(x, sizeof(float) * e.n_embd * n_tokens, stream, "expert input");
    DeviceBuffer idd = upload(ids, sizeof(int32_t) * n_tokens * k, stream, "expert ids");
    DeviceBuffer wd = upload(weights, sizeof(float) * n_tokens * k, stream, "expert weights");
    DeviceBuffer out(sizeof(float) * e.n_embd * n_tokens, "expert output");
    DeviceBuffer gate_b =
        upload(e.gate_b, e.gate_b ? sizeof(float) * e.n_expert * e.n_ff : 0, stream, "gate bias");
    DeviceBuffer up_b = upload(e.up_b, e.up_b ? sizeof(float) * e.n_expert * e.n_ff : 0, stream, "up bias");
    DeviceBuffer down_b =
        upload(e.down_b, e.down_b ? sizeof(float) * e.n_expert * e.n_embd : 0, stream, "down bias");
    ExpertWeights w{gate.data(), up.data(),   down.data(), e.gate_type,
                    e.up_type,   e.down_type, e.n_embd,    e.n_ff};
    w.act = expert_activation_for(e.relu_sqr, e.swiglu_clamp, e.swiglu_limit);
    w.gate_b = e.gate_b ? gate_b.as<float>() : nullptr;
    w.up_b = e.up_b ? up_b.as<float>() : nullptr;
    w.down_b = e.down_b ? down_b.as<float>() : nullptr;
    DeviceBuffer scratch(expert_ffn_scratch_bytes(w, grouped ? n_tokens : 1, k, int8), "expert scratch");
    if (grouped) {
        launch_expert_ffn_grouped(w, xd.as<float>(), n_tokens, ids, wd.as<float>(), k, int8, scratch.data(),
                                  out.as<float>(), stream.get());
    } else {
        for (int64_t t = 0; t < n_tokens; ++t) {
            launch_expert_ffn_decode(w, xd.as<float>() + t * e.n_embd, idd.as<int32_t>() + t * k,
                                     wd.as<float>() + t * k, k, int8, scratch.data(),
                                     out.as<float>() + t * e.n_embd, stream.get());
        }
    }
    return download<float>(out, static_cast<size_t>(e.n_embd * n_tokens), stream, "expert_ffn");
}

}  // namespace sharpi::cuda
