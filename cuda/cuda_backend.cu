// The CUDA backend (cuda_backend.cuh): each op is its check against the support table, then the
// launches of cuda/ops that device_forward.cu makes for the same step, on the one compute stream.
// Strided operands the kernels take contiguous (a row stride other than the width) go through arena
// scratch with one 2-D copy each way.
#include <algorithm>
#include <memory>
#include <string>

#include "backend/cuda_interface.h"
#include "cpu/ops/router.h"
#include "cuda_backend.cuh"
#include "model/model.h"
#include "ops/activation.cuh"
#include "ops/attention.cuh"
#include "ops/dequantize.cuh"
#include "ops/elementwise.cuh"
#include "ops/expert_ffn.cuh"
#include "ops/matvec.cuh"
#include "ops/rms_norm.cuh"
#include "ops/rope.cuh"
#include "ops/router.cuh"
#include "sharpi/errors.h"

namespace sharpi::cuda {

// ---- weights ------------------------------------------------------------------------------------

DeviceWeights::DeviceWeights(const std::vector<HostWeight>& host, const Stream& stream,
                             const std::string& what) {
    size_t total = 0;
    std::vector<size_t> offsets;
    for (const HostWeight& w : host) {
        offsets.push_back(total);
        total += (w.bytes + 255) / 256 * 256;
    }
    buffer_ = DeviceBuffer(total, what);
    for (size_t i = 0; i < host.size(); ++i) {
        if (host[i].bytes == 0) continue;
        unsigned char* dst = buffer_.as<unsigned char>() + offsets[i];
        copy_to_device(dst, host[i].data, host[i].bytes, stream, host[i].name);
        const auto* begin = static_cast<const unsigned char*>(host[i].data);
        ranges_[begin] = Range{begin + host[i].bytes, dst};
    }
}

const void* DeviceWeights::device_of(const void* host, const std::string& what) const {
    if (host == nullptr) return nullptr;
    const auto* p = static_cast<const unsigned char*>(host);
    auto it = ranges_.upper_bound(p);
    if (it != ranges_.begin()) {
        --it;
        if (p < it->second.host_end) return it->second.device + (p - it->first);
    }
    throw DeviceError("[cuda] " + what + ": a weight that was not uploaded to the device");
}

namespace {

constexpr size_t kFirstArenaBlock = size_t{16} << 20;

size_t aligned(size_t bytes) {
    return (bytes + 255) / 256 * 256;
}

// Types, shape and activation of a routed expert as the expert kernels take them (the rows and
// biases come separately).
ExpertWeights expert_shape(const ExpertFfnWeights& e) {
    return ExpertWeights{
        nullptr,       nullptr,       nullptr,
        e.gate.type,   e.up.type,     e.down.type,
        e.gate.n_cols, e.gate.n_rows, expert_activation_for(e.relu_sqr, e.swiglu_clamp, e.swiglu_limit)};
}

void require_same_shape(const ExpertFfnWeights* experts, int64_t n, const char* op) {
    for (int64_t i = 1; i < n; ++i) {
        const ExpertFfnWeights& a = experts[0];
        const ExpertFfnWeights& b = experts[i];
        if (a.gate.type != b.gate.type || a.up.type != b.up.type || a.down.type != b.down.type ||
            a.gate.n_rows != b.gate.n_rows || a.gate.n_cols != b.gate.n_cols || a.relu_sqr != b.relu_sqr ||
            a.swiglu_clamp != b.swiglu_clamp || a.swiglu_limit != b.swiglu_limit) {
            throw InvalidArgument(std::string("[cuda] ") + op +
                                  ": the experts of one call differ in type, shape or activation");
        }
    }
}

}  // namespace

// ---- the backend --------------------------------------------------------------------------------

CudaBackend::CudaBackend(const Model& model) : model_(model) {
    weights_ = DeviceWeights(device_weights(model), stream_, "weights of " + model.hp.arch);
    one_ = DeviceBuffer(sizeof(float), "unit expert weight");
    const float one = 1.0f;
    copy_to_device(one_.data(), &one, sizeof(float), stream_, "unit expert weight");
    arena_.emplace_back(kFirstArenaBlock, "activations");
    kv_.resize(static_cast<size_t>(model.hp.n_layer));
    stream_.synchronize("upload of " + model.hp.arch + " to the device");
}

void CudaBackend::check(const OpCall& call) const {
    const std::string why = unsupported_op(call);
    if (!why.empty()) throw UnsupportedError("[cuda] " + why);
}

void CudaBackend::check(const std::vector<OpCall>& calls) const {
    for (const OpCall& c : calls) check(c);
}

void CudaBackend::refuse(const OpCall& call) const {
    check(call);
    throw DeviceError("[cuda] " + call.op +
                      ": listed as implemented, but the CUDA backend has no launch for it");
}

const void* CudaBackend::weight(const void* host, const char* op) const {
    return weights_.device_of(host, op);
}

const float* CudaBackend::weight_f32(const float* host, const char* op) const {
    return static_cast<const float*>(weights_.device_of(host, op));
}

void* CudaBackend::take(size_t bytes) {
    bytes = aligned(std::max<size_t>(bytes, 1));
    if (arena_used_ + bytes > arena_.back().size()) {
        // A new block; the older ones stay valid until reset_activations.
        const size_t size = std::max(bytes, 2 * arena_.back().size());
        arena_.emplace_back(size, "activations");
        arena_used_ = 0;
    }
    void* p = arena_.back().as<unsigned char>() + arena_used_;
    arena_used_ += bytes;
    arena_total_ += bytes;
    return p;
}

Act CudaBackend::alloc(int64_t n_tokens, int64_t width) {
    return Act{take_floats(n_tokens * width), n_tokens, width};
}

void CudaBackend::reset_activations() {
    if (arena_.size() > 1) {
        // One block of everything the last layer took (cudaFree waits for the kernels that use them).
        const size_t size = aligned(arena_total_);
        arena_.clear();
        arena_.emplace_back(size, "activations");
    }
    arena_used_ = 0;
    arena_total_ = 0;
}

Act CudaBackend::residual(int64_t n_tokens, int64_t width) {
    const size_t bytes = sizeof(float) * static_cast<size_t>(n_tokens * width);
    if (bytes > residual_.size()) {
        stream_.synchronize("residual stream resize");
        residual_ = DeviceBuffer(bytes, "residual stream");
    }
    return Act{residual_.as<float>(), n_tokens, width};
}

template <typename T>
T* CudaBackend::upload(const T* host, int64_t n, const char* what) {
    T* dst = static_cast<T*>(take(sizeof(T) * static_cast<size_t>(n)));
    if (n > 0) copy_to_device(dst, host, sizeof(T) * static_cast<size_t>(n), stream_, what);
    return dst;
}

void CudaBackend::copy_2d(const float* src, int64_t ld_src, float* dst, int64_t ld_dst, int64_t n_rows,
                          int64_t width, const char* what) {
    if (n_rows <= 0 || width <= 0) return;
    const size_t f = sizeof(float);
    cuda_check(cudaMemcpy2DAsync(dst, f * ld_dst, src, f * ld_src, f * width, static_cast<size_t>(n_rows),
                                 cudaMemcpyDeviceToDevice, stream_.get()),
               what);
}

void CudaBackend::read(const Act& x, float* host) {
    const size_t bytes = sizeof(float) * static_cast<size_t>(x.n_tokens * x.width);
    // cudaMemcpyDefault: x may also be host memory the builders name (the router's weights in a dump).
    cuda_check(cudaMemcpyAsync(host, x.data, bytes, cudaMemcpyDefault, stream_.get()), "read");
    stream_.synchronize("read of " + std::to_string(x.n_tokens) + " rows");
}

void CudaBackend::copy(const Act& src, const Act& dst) {
    check(OpCall{"copy", GgmlType::F32, ""});
    copy_2d(src.data, src.width, dst.data, dst.width, src.n_tokens, src.width, "copy");
}

void CudaBackend::copy_rows(const float* src, int64_t ld_src, float* dst, int64_t ld_dst, int64_t n_rows,
                            int64_t width) {
    check(OpCall{"copy_rows", GgmlType::F32, ""});
    copy_2d(src, ld_src, dst, ld_dst, n_rows, width, "copy_rows");
}

// ---- dense ops ----------------------------------------------------------------------------------

void CudaBackend::get_rows(const WeightView& table, const token_t* tokens, const Act& x) {
    check(OpCall{"get_rows", table.type, ""});
    const auto* base = static_cast<const unsigned char*>(weight(table.data, "get_rows"));
    for (int64_t t = 0; t < x.n_tokens; ++t) {
        if (tokens[t] < 0 || tokens[t] >= table.n_rows)
            throw InvalidArgument("[cuda] get_rows: token " + std::to_string(tokens[t]) +
                                  " out of the table");
        launch_dequantize(table.type, base + static_cast<size_t>(tokens[t]) * table.row_bytes, x.row(t),
                          x.width, stream_.get());
    }
}

void CudaBackend::rms_norm(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t n_rows, int64_t width,
                           const float* weight, float eps) {
    check(OpCall{"rms_norm", GgmlType::F32, ""});
    const float* w = weight_f32(weight, "rms_norm");
    if (ldx == width && ldy == width) {
        launch_rms_norm(x, w, n_rows, width, eps, y, stream_.get());
        return;
    }
    float* tmp = take_floats(n_rows * width);
    copy_2d(x, ldx, tmp, width, n_rows, width, "rms_norm input");
    launch_rms_norm(tmp, w, n_rows, width, eps, tmp, stream_.get());
    copy_2d(tmp, width, y, ldy, n_rows, width, "rms_norm output");
}

// As device_forward.cu's linear: exact, f32 activations on dequantized rows; fast, the q8 paths
// (launch_linear picks the matvec for one token and the tiled matmul for a batch).
void CudaBackend::matmul(const WeightView& w, const float* x, int64_t ldx, int64_t n_tokens, float* y,
                         int64_t ldy, bool exact) {
    check(matmul_call(w, exact));
    const int64_t n_rows = w.n_rows, n_cols = w.n_cols;
    const float* xin = x;
    if (ldx != n_cols) {
        float* tmp = take_floats(n_tokens * n_cols);
        copy_2d(x, ldx, tmp, n_cols, n_tokens, n_cols, "matmul input");
        xin = tmp;
    }
    float* out = ldy == n_rows ? y : take_floats(n_tokens * n_rows);
    void* xq = exact ? nullptr : take(q8_act_row_bound(n_cols) * static_cast<size_t>(n_tokens));
    launch_linear(w.type, weight(w.data, "matmul"), n_rows, n_cols, xin, n_tokens, !exact, xq, out,
                  stream_.get());
    if (out != y) copy_2d(out, n_rows, y, ldy, n_tokens, n_rows, "matmul output");
}

void CudaBackend::add_bias(const Act& y, const float* bias) {
    check(OpCall{"add_bias", GgmlType::F32, ""});
    launch_add_bias(y.data, weight_f32(bias, "add_bias"), y.n_tokens, y.width, stream_.get());
}

void CudaBackend::add(const Act& a, const Act& b, const Act& y) {
    check(OpCall{"add", GgmlType::F32, ""});
    launch_add(a.data, b.data, a.n_tokens * a.width, y.data, stream_.get());
}

void CudaBackend::swiglu(const float* gate, const float* up, float* out, int64_t n) {
    check(OpCall{"swiglu", GgmlType::F32, ""});
    launch_silu_mul(gate, up, n, out, stream_.get());
}

void CudaBackend::mul_sigmoid(float*, const float*, int64_t) {
    refuse(OpCall{"mul_sigmoid", GgmlType::F32, ""});
}

void CudaBackend::mul_silu(float*, const float*, int64_t) {
    refuse(OpCall{"mul_silu", GgmlType::F32, ""});
}

// scales: host memory (the routing weights, llama4's per-position attention temperature).
void CudaBackend::scale_rows(const Act& x, const float* scales) {
    check(OpCall{"scale_rows", GgmlType::F32, ""});
    const float* s = upload(scales, x.n_tokens, "row scales");
    launch_scale_rows(x.data, s, x.n_tokens, x.width, stream_.get());
}

void CudaBackend::scale_rows_sigmoid(const Act& x, const Act& s) {
    check(OpCall{"scale_rows_sigmoid", GgmlType::F32, ""});
    if (s.width != 1) throw InvalidArgument("[cuda] scale_rows_sigmoid: the gate must be [n_tokens, 1]");
    launch_sigmoid_scale(x.data, s.data, x.n_tokens, x.width, stream_.get());
}

void CudaBackend::rope(float* x, int64_t ld, int64_t n_tokens, int64_t n_heads, int64_t head_dim,
                       int64_t pos0, const RopeParams& p) {
    check(rope_call(p));
    // The factors are host floats of the model (rope_freqs), n_rot / 2 of them: copied per call.
    const float* factors =
        p.freq_factors ? upload(p.freq_factors, p.n_rot / 2, "rope frequency factors") : nullptr;
    launch_rope(x, ld, n_tokens, n_heads, head_dim, pos0, device_rope(p, factors), stream_.get());
}

// ---- attention ----------------------------------------------------------------------------------

CudaBackend::LayerKv& CudaBackend::layer_kv(const KvCache& kv, int il) {
    if (il < 0 || il >= static_cast<int>(kv_.size()))
        throw InvalidArgument("[cuda] KV cache: layer " + std::to_string(il) + " out of range");
    LayerKv& d = kv_[static_cast<size_t>(il)];
    if (d.n_ctx != kv.n_ctx() || d.width != kv.row_width()) {
        d.n_ctx = kv.n_ctx();
        d.width = kv.row_width();
        const size_t bytes = sizeof(float) * static_cast<size_t>(d.n_ctx * d.width);
        d.k = DeviceBuffer(bytes, "K cache of layer " + std::to_string(il));
        d.v = DeviceBuffer();
    }
    return d;
}

void CudaBackend::kv_store(KvCache& kv, int il, int64_t pos0, const Act& k, const Act* v) {
    check(kv_store_calls(kv.type_k(), kv.type_v(), v != nullptr));
    LayerKv& d = layer_kv(kv, il);
    if (pos0 < 0 || pos0 + k.n_tokens > d.n_ctx || k.width != d.width || (v && v->width != d.width)) {
        throw InvalidArgument("[cuda] kv_store: rows " + std::to_string(pos0) + ".." +
                              std::to_string(pos0 + k.n_tokens) + " of width " + std::to_string(k.width) +
                              " do not fit the cache of " + std::to_string(d.n_ctx) + " x " +
                              std::to_string(d.width));
    }
    copy_2d(k.data, k.width, d.k.as<float>() + pos0 * d.width, d.width, k.n_tokens, d.width, "kv_store K");
    if (v == nullptr) return;
    if (d.v.size() == 0) d.v = DeviceBuffer(d.k.size(), "V cache of layer " + std::to_string(il));
    copy_2d(v->data, v->width, d.v.as<float>() + pos0 * d.width, d.width, v->n_tokens, d.width, "kv_store V");
}

void CudaBackend::attention(const float* q, int64_t ldq, const KvCache& kv, int il, int64_t n_tokens,
                            int64_t pos0, const AttentionShape& shape, float* out, int64_t ldo) {
    check(attention_call(kv.type_k(), shape));
    LayerKv& d = layer_kv(kv, il);
    if (d.v.size() == 0 || d.width != shape.n_head_kv * shape.head_dim || pos0 + n_tokens > d.n_ctx) {
        throw InvalidArgument("[cuda] attention: layer " + std::to_string(il) +
                              " has no stored K/V rows of the attention's shape up to position " +
                              std::to_string(pos0 + n_tokens));
    }
    const int64_t width = shape.n_head * shape.head_dim;
    const float* qin = q;
    if (ldq != width) {
        float* tmp = take_floats(n_tokens * width);
        copy_2d(q, ldq, tmp, width, n_tokens, width, "attention query");
        qin = tmp;
    }
    float* o = ldo == width ? out : take_floats(n_tokens * width);
    DeviceAttentionLimits limits;
    limits.window = shape.window;
    limits.chunk = shape.chunk;
    limits.sinks = shape.sinks ? weight_f32(shape.sinks, "attention") : nullptr;
    launch_attention(qin, d.k.as<float>(), d.v.as<float>(), n_tokens, pos0, shape.n_head, shape.n_head_kv,
                     shape.head_dim, shape.scale, o, stream_.get(), limits);
    if (o != out) copy_2d(o, width, out, ldo, n_tokens, width, "attention output");
}

void CudaBackend::mla_attention(const float*, int64_t, const KvCache& kv, int, int64_t, int64_t,
                                const MlaShape&, const MlaSelection*, float*, int64_t) {
    refuse(OpCall{"mla_attention", kv.type_k(), ""});
}

void CudaBackend::lightning_indexer(const float*, int64_t, const float*, int64_t, const KvCache& kv, int,
                                    int64_t, int64_t, const IndexerShape&, int32_t*, int32_t*) {
    refuse(OpCall{"lightning_indexer", kv.type_k(), ""});
}

void CudaBackend::layer_norm(const float*, int64_t, float*, int64_t, int64_t, int64_t, const float*,
                             const float*, float) {
    refuse(OpCall{"layer_norm", GgmlType::F32, ""});
}

// ---- Gated DeltaNet: no kernels yet (the table says so) -------------------------------------------

void CudaBackend::gdn_gates(const Act&, const Act&, const float*, const float*, const Act&, const Act&) {
    refuse(OpCall{"gdn_gates", GgmlType::F32, ""});
}

void CudaBackend::conv1d_silu(float*, const float*, int64_t, int64_t, int64_t, int64_t, const float*,
                              const float*, float*, int64_t) {
    refuse(OpCall{"conv1d_silu", GgmlType::F32, ""});
}

void CudaBackend::l2_norm_heads(const Act&, int64_t, int64_t, int64_t, float) {
    refuse(OpCall{"l2_norm_heads", GgmlType::F32, ""});
}

void CudaBackend::gated_delta_rule(const GdnInputs&, int64_t, const GdnShape&, int64_t, float*, float*,
                                   int64_t) {
    refuse(OpCall{"gated_delta_rule", GgmlType::F32, ""});
}

// ---- Mamba-2 and the squared ReLU: no kernels yet (the table says so) -----------------------------

void CudaBackend::ssm_scan(const SsmInputs&, int64_t, const SsmShape&, float*, float*, int64_t) {
    refuse(OpCall{"ssm_scan", GgmlType::F32, ""});
}

// ---- DeepSeek-V4: no kernels yet (the table says so) ----------------------------------------------

void CudaBackend::rms_norm_unweighted(const float*, float*, int64_t, int64_t, int64_t, float) {
    refuse(OpCall{"rms_norm_unweighted", GgmlType::F32, ""});
}
void CudaBackend::swiglu_clamped(const float* gate, const float* up, float* out, int64_t n, float limit) {
    check(OpCall{"swiglu_clamped", GgmlType::F32, ""});
    ExpertActivation act;
    act.kind = ExpertActKind::swiglu_clamped;
    act.limit = limit;
    launch_expert_activation(act, gate, up, nullptr, nullptr, 1, n, out, stream_.get());
}
void CudaBackend::hc_block_weights(const float*, int64_t, int64_t, const float*, const float*, float, int64_t,
                                   float*, float*, float*) {
    refuse(OpCall{"hc_block_weights", GgmlType::F32, ""});
}
void CudaBackend::hc_head_weights(const float*, int64_t, int64_t, const float*, const float*, float, float*) {
    refuse(OpCall{"hc_head_weights", GgmlType::F32, ""});
}
void CudaBackend::hc_collapse(const float*, int64_t, int64_t, int64_t, const float*, float*) {
    refuse(OpCall{"hc_collapse", GgmlType::F32, ""});
}
void CudaBackend::hc_expand(const float*, const float*, int64_t, int64_t, int64_t, const float*, const float*,
                            float*) {
    refuse(OpCall{"hc_expand", GgmlType::F32, ""});
}
void CudaBackend::compressed_attention(const CompressedAttentionInputs&, KvCache& kv, int, int64_t, int64_t,
                                       const CompressedAttentionShape& shape, float*, int64_t) {
    refuse(OpCall{"compressed_attention", kv.type_k(), "ratio=" + std::to_string(shape.ratio)});
}

void CudaBackend::relu_sqr(const float* x, float* out, int64_t n) {
    check(OpCall{"relu_sqr", GgmlType::F32, ""});
    ExpertActivation act;
    act.kind = ExpertActKind::relu_sqr;
    launch_expert_activation(act, nullptr, x, nullptr, nullptr, 1, n, out, stream_.get());
}

// ---- MoE ----------------------------------------------------------------------------------------

// The router on the device; the ids and weights come back to the host (the one wait of a MoE layer).
void CudaBackend::route_topk(const Act& logits, int64_t k, const RouterParams& params, const Act& probs,
                             int32_t* ids, float* weights) {
    check(route_topk_call(params, logits.width));
    const int64_t T = logits.n_tokens, n = T * k;
    auto* ids_dev = static_cast<int32_t*>(take(sizeof(int32_t) * static_cast<size_t>(n)));
    float* weights_dev = take_floats(n);
    DeviceRouterSpec spec;
    spec.gating = params.gating;
    spec.normalize = params.normalize_topk;
    spec.scale = params.weights_scale;
    spec.selection_bias = params.selection_bias ? weight_f32(params.selection_bias, "route_topk") : nullptr;
    spec.rank_logits = params.rank_logits;
    launch_router_topk(logits.data, T, logits.width, k, spec, ids_dev, weights_dev, stream_.get(),
                       probs.data);
    copy_to_host(ids, ids_dev, sizeof(int32_t) * static_cast<size_t>(n), stream_, "expert ids");
    copy_to_host(weights, weights_dev, sizeof(float) * static_cast<size_t>(n), stream_, "expert weights");
    stream_.synchronize("route_topk of " + std::to_string(T) + " tokens");
}

// Host arithmetic on host memory (route-trace replay): the CPU's rule, which the device router's
// weights follow (gating scores, renormalised and scaled per the arch).
void CudaBackend::topk_weights(const float* probs, const int32_t* ids, int64_t k, const RouterParams& params,
                               float* weights) {
    check(OpCall{"topk_weights", GgmlType::F32, ""});
    cpu::topk_weights(probs, ids, k, params, weights);
}

void CudaBackend::expert_ffn_one_token(const ExpertFfnWeights* experts, const float* weights, int k,
                                       const float* x, float* out, bool exact) {
    check(expert_calls("expert_ffn_one_token", experts, k, exact));
    if (k < 1 || k > kMaxSlotTable) {
        throw UnsupportedError("[cuda] expert_ffn_one_token: " + std::to_string(k) +
                               " experts per token (the slot table holds 1.." +
                               std::to_string(kMaxSlotTable) + ")");
    }
    require_same_shape(experts, k, "expert_ffn_one_token");
    const ExpertWeights w = expert_shape(experts[0]);
    ExpertSlotTable table{};
    for (int j = 0; j < k; ++j) set_slot(table, j, experts[j], "expert_ffn_one_token");
    const float* weights_dev = upload(weights, k, "expert weights");
    void* scratch = take(expert_ffn_scratch_bytes(w, 1, k, !exact));
    launch_expert_ffn_decode_slots(w, table, x, weights_dev, k, !exact, scratch, out, stream_.get());
}

// Slot j of a slot table: the expert's parts and its biases (device copies; null where none).
void CudaBackend::set_slot(ExpertSlotTable& table, int j, const ExpertFfnWeights& e, const char* op) const {
    table.gate[j] = weight(e.gate.data, op);
    table.up[j] = weight(e.up.data, op);
    table.down[j] = weight(e.down.data, op);
    table.gate_b[j] = weight_f32(e.gate_b, op);
    table.up_b[j] = weight_f32(e.up_b, op);
    table.down_b[j] = weight_f32(e.down_b, op);
}

// Each slot alone through the fused kernel with the unit weight: its combine is 0 + 1 * row, the row
// itself, so moe_combine over these rows gives expert_ffn_one_token's bits.
void CudaBackend::expert_ffn_slots(const ExpertFfnWeights* experts, const int64_t* slots, int64_t n_slots,
                                   const float* x, const Act& y, bool exact) {
    check(expert_calls("expert_ffn_slots", experts, n_slots, exact));
    require_same_shape(experts, n_slots, "expert_ffn_slots");
    if (n_slots == 0) return;
    const ExpertWeights w = expert_shape(experts[0]);
    void* scratch = take(expert_ffn_scratch_bytes(w, 1, 1, !exact));
    for (int64_t i = 0; i < n_slots; ++i) {
        ExpertSlotTable table{};
        set_slot(table, 0, experts[i], "expert_ffn_slots");
        launch_expert_ffn_decode_slots(w, table, x, one_.as<float>(), 1, !exact, scratch, y.row(slots[i]),
                                       stream_.get());
    }
}

// The grouped prefill path (GroupedExpertFfn's arithmetic): the members' token rows gathered once,
// then each expert over its contiguous members through launch_expert_rows, straight into y.
void CudaBackend::expert_ffn_batch(const ExpertFfnWeights* experts, const int64_t* member_begin,
                                   const int64_t* member_end, int n_experts, const int64_t* tokens,
                                   const float* x, int64_t ldx, float* y, int64_t ldy, bool exact) {
    check(expert_calls("expert_ffn_batch", experts, n_experts, exact));
    if (n_experts == 0) return;
    const int64_t n_embd = experts[0].gate.n_cols, n_ff = experts[0].gate.n_rows;
    if (ldx != n_embd || ldy != n_embd) {
        throw InvalidArgument("[cuda] expert_ffn_batch: row strides " + std::to_string(ldx) + " / " +
                              std::to_string(ldy) + " (the device path takes contiguous rows of " +
                              std::to_string(n_embd) + ")");
    }
    int64_t lo = member_begin[0], hi = member_end[0], widest = 0;
    for (int e = 0; e < n_experts; ++e) {
        lo = std::min(lo, member_begin[e]);
        hi = std::max(hi, member_end[e]);
        widest = std::max(widest, member_end[e] - member_begin[e]);
        if (experts[e].gate.n_cols != n_embd || experts[e].gate.n_rows != n_ff)
            throw InvalidArgument("[cuda] expert_ffn_batch: the experts of one call differ in shape");
    }
    if (hi <= lo) return;
    std::vector<int32_t> rows(static_cast<size_t>(hi - lo));
    for (int64_t m = lo; m < hi; ++m) rows[static_cast<size_t>(m - lo)] = static_cast<int32_t>(tokens[m]);
    const int32_t* rows_dev = upload(rows.data(), hi - lo, "expert member rows");
    float* xg = take_floats((hi - lo) * n_embd);
    launch_gather_rows(x, rows_dev, hi - lo, n_embd, xg, stream_.get());
    float* g = take_floats(widest * n_ff);
    float* u = take_floats(widest * n_ff);
    float* h = take_floats(widest * n_ff);
    void* xq = exact ? nullptr : take(q8_act_row_bound(n_embd) * static_cast<size_t>(widest));
    void* hq = exact ? nullptr : take(q8_act_row_bound(n_ff) * static_cast<size_t>(widest));
    for (int e = 0; e < n_experts; ++e) {
        const int64_t b = member_begin[e], c = member_end[e] - b;
        if (c <= 0) continue;
        const ExpertFfnWeights& ex = experts[e];
        ExpertBiases biases;
        biases.gate = weight_f32(ex.gate_b, "expert_ffn_batch");
        biases.up = weight_f32(ex.up_b, "expert_ffn_batch");
        biases.down = weight_f32(ex.down_b, "expert_ffn_batch");
        launch_expert_rows(expert_shape(ex), weight(ex.gate.data, "expert_ffn_batch"),
                           weight(ex.up.data, "expert_ffn_batch"), weight(ex.down.data, "expert_ffn_batch"),
                           biases, xg + (b - lo) * n_embd, c, !exact, g, u, h, xq, hq, y + b * ldy,
                           stream_.get());
    }
}

void CudaBackend::moe_combine(const Act& y, const int64_t* member_of, const float* weights, int64_t k,
                              const Act& out) {
    check(OpCall{"moe_combine", GgmlType::F32, ""});
    const int64_t n = out.n_tokens * k;
    std::vector<int32_t> order(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = static_cast<int32_t>(member_of[i]);
    const int32_t* order_dev = upload(order.data(), n, "expert output rows");
    const float* weights_dev = upload(weights, n, "expert weights");
    launch_expert_combine(y.data, weights_dev, order_dev, out.n_tokens, k, out.width, out.data,
                          stream_.get());
}

std::unique_ptr<Backend> make_cuda_backend(const Model& model) {
    // Before the backend's stream exists, so a missing device is reported as such.
    require_device("the CUDA backend for " + model.hp.arch);
    return std::make_unique<CudaBackend>(model);
}

}  // namespace sharpi::cuda
