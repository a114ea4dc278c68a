// The device forward pass (backend/cuda_interface.h DeviceForward) for the plain MoE archs: the CPU engine's
// decoder_layer (model/forward.cpp, moe/moe_ffn.cpp) op for op, on the device.
//
// Owns: a device copy of every tensor of device_weights() (one allocation, uploaded once at open,
// in the file's types), the f32 KV cache ([n_layer][K | V][n_ctx, n_embd_kv]), the activation arena
// of device_plan.h, one compute stream and two pinned host buffers (a prefill layer's expert ids,
// the logits). Everything of a batch is queued on the one stream; the host waits on it for the
// logits at the end of each chunk of max_batch tokens and, in a prefill chunk, once per MoE layer to
// read the expert ids back (the grouped expert FFN plans its groups on the host). Decoding one token
// never waits mid-pass: the routing goes to the device, is read by the fused expert kernel there,
// and comes back with the logits.
//
// Streamed experts (open_device_forward's `streamed`): the stacked expert tensors are not uploaded;
// an ExpertCache in the VRAM tier (device_tier.cu) holds the experts in slots filled on its copy
// stream. Then every MoE layer waits once on the host for its ids (the cache decides on the host),
// acquires the layer's experts (sorted unique ids, as the CPU's MoE FFN), makes the compute stream
// wait on exactly those experts' copy events, runs the same expert kernels through a slot table
// (decode) or one expert group per slot (prefill, in waves of at most the cache's slots), marks the
// end of those reads for the copy stream and releases. Same kernels, same order: the same bits.
// CPU compute of misses (moe/cpu_miss.h; decode only): the misses the mode routes to the CPU are not
// acquired; the CPU kernels compute them from the mapping on the session's pool while the device
// waits, their rows go up with the slot table's cpu_rows, and the kernels skip those slots.
//
// Per layer, with T tokens at positions pos .. pos + T - 1 (x: the residual stream):
//   cur = rms_norm(x) · attn_norm;  q = Wq cur (+b);  K rows pos.. = Wk cur (+b);  V rows = Wv cur (+b)
//   q/k norm (per head or full width; qwen3moe, olmoe), RoPE on q and the new K rows in place,
//   attention over the cache rows 0 .. pos + t, tmp = Wo attn;  ffn_inp = tmp + x
//   cur = rms_norm(ffn_inp) · ffn_norm;  router logits, softmax top-k (renormalised per the arch)
//   tmp = fused expert FFN (decode: one token; prefill: grouped by expert)
//   (+ sigmoid(w_gate · cur) · shared expert FFN (qwen2moe));  x = tmp + ffn_inp
// Exact mode: every product on dequantized weights with f32 activations. Fast mode: every product
// with a quantized weight type on q8 activations (the int8 matvec / tiled matmul), as the CPU.
#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda_interface.h"
#include "cpu/ops/expert_ffn.h"
#include "cuda_backend.cuh"
#include "device_memory.cuh"
#include "device_plan.h"
#include "device_tier.cuh"
#include "model/model.h"
#include "moe/cpu_miss.h"
#include "moe/expert_cache.h"
#include "moe/moe_ffn.h"
#include "ops/activation.cuh"
#include "ops/attention.cuh"
#include "ops/dequantize.cuh"
#include "ops/elementwise.cuh"
#include "ops/expert_ffn.cuh"
#include "ops/matvec.cuh"
#include "ops/rms_norm.cuh"
#include "ops/rope.cuh"
#include "ops/router.cuh"
#include "trace/timeline.h"

namespace sharpi::cuda {
namespace {

// y = W x (+ bias) with W on the device: [n_out rows, n_in cols] of `type`.
struct DeviceLinear {
    const void* w = nullptr;
    GgmlType type = GgmlType::F32;
    int64_t n_out = 0, n_in = 0;
    const float* bias = nullptr;
    bool present() const { return w != nullptr; }
};

enum class QkNormKind { none, per_head, full };

struct DeviceLayer {
    const float* attn_norm = nullptr;
    DeviceLinear wq, wk, wv, wo;
    QkNormKind qk_norm = QkNormKind::none;
    const float* q_norm = nullptr;
    const float* k_norm = nullptr;
    const float* ffn_norm = nullptr;
    bool moe = false;
    DeviceLinear router;
    ExpertWeights experts{};
    DeviceLinear ffn_gate, ffn_up, ffn_down;  // dense FFN, or the shared expert of a MoE layer
    DeviceLinear shexp_gate;                  // [1, n_embd]; absent: the shared expert is not gated
};

class CudaForward final : public DeviceForward {
  public:
    CudaForward(const Model& model, DevicePlan plan, bool exact, const ExpertCacheOptions* streamed,
                const CpuMissOptions* misses);
    void forward(const int32_t* tokens, int64_t n_tokens, int64_t pos0, bool all_logits, float* logits,
                 std::vector<std::vector<int32_t>>& routing, const std::function<void(int)>& check_cancel,
                 GateObserver* observer) override;
    const DevicePlan& plan() const override { return plan_; }
    ExpertCache* expert_cache() override { return cache_.get(); }
    void set_timeline(Timeline* timeline) override;
    void add_miss_stats(ExpertCacheStats& st) const override {
        if (misses_.mode == MissMode::copy) return;
        st.cpu_experts += cpu_experts_;
        st.miss_copy_bytes_per_s = misses_.copy_bytes_per_s;
        st.miss_copy_latency_s = misses_.copy_latency_s;
        st.miss_cpu_bytes_per_s = misses_.cpu_bytes_per_s;
    }

  private:
    template <typename T = float>
    T* arena(size_t offset) const {
        return reinterpret_cast<T*>(arena_.as<unsigned char>() + offset);
    }
    float* k_cache(int il) const { return kv_.as<float>() + 2 * static_cast<int64_t>(il) * kv_layer_floats_; }
    float* v_cache(int il) const { return k_cache(il) + kv_layer_floats_; }
    // The device copy of a host tensor of device_weights() (nullptr for nullptr / an empty vector).
    const void* device_of(const void* host) const;
    DeviceLinear linear_of(const WeightView& w, const std::vector<float>* bias = nullptr) const;

    void linear(const DeviceLinear& l, const float* x, int64_t n_tokens, float* y) const;
    void dense_ffn(const DeviceLayer& L, const float* x, int64_t n_tokens, float* y) const;
    // CPU compute of misses: the buffers, and the cost model's inputs measured where not given.
    void open_cpu_misses(const CpuMissOptions& misses);
    // The routed experts of a MoE layer from the VRAM tier: ids [T, k] and weights on the device.
    void streamed_experts(int il, const DeviceLayer& L, int64_t n_tokens, const float* cur,
                          const float* ffn_inp, const float* router_logits, const int32_t* ids,
                          const float* weights, float* out, GateObserver* observer);
    // One chunk of at most max_batch tokens through every layer; routing ids at arena routing.
    void layer(int il, int64_t n_tokens, int64_t pos, GateObserver* observer);
    void chunk(const int32_t* tokens, int64_t n_tokens, int64_t pos, int64_t first_logit_row, float* logits,
               std::vector<std::vector<int32_t>>& routing, const std::function<void(int)>& check_cancel,
               GateObserver* observer);

    const Model& model_;
    const HParams& h_;
    DevicePlan plan_;
    bool int8_;
    DeviceArena layout_;
    int64_t kv_layer_floats_ = 0;  // n_ctx * n_embd_kv
    Stream stream_;
    DeviceWeights weights_;  // every upload, 256-byte aligned
    DeviceBuffer kv_;
    DeviceBuffer arena_;
    PinnedBuffer ids_host_;     // [max_batch, k] int32
    PinnedBuffer logits_host_;  // [max_batch, n_vocab] f32
    // Streamed experts only: the VRAM tier, its filler (owned by the cache), and the gate inputs a
    // decode step hands to the observer ([n_embd] ffn_inp then [n_expert] router logits, f32).
    std::unique_ptr<ExpertCache> cache_;
    VramFills* fills_ = nullptr;
    PinnedBuffer gate_host_;
    // CPU compute of misses: the options (bandwidths measured at open when not given), the host
    // bytes of every expert (the mapping), the activation row and the CPU's output rows [k, n_embd].
    CpuMissOptions misses_;
    std::unique_ptr<ResidentExperts> host_experts_;
    PinnedBuffer cpu_x_, cpu_rows_;
    uint64_t cpu_experts_ = 0;
    // The timeline's "compute stream" track: timing events around each layer of the current chunk,
    // read after the chunk's final wait and placed on the host clock (DeviceClock).
    Timeline* timeline_ = nullptr;
    std::unique_ptr<DeviceClock> clock_;
    std::vector<Event> layer_begin_, layer_end_;
    std::vector<DeviceLayer> layers_;
    const void* token_embd_ = nullptr;
    const float* output_norm_ = nullptr;
    DeviceLinear output_;
};

CudaForward::CudaForward(const Model& model, DevicePlan plan, bool exact, const ExpertCacheOptions* streamed,
                         const CpuMissOptions* misses)
    : model_(model), h_(model.hp), plan_(std::move(plan)), int8_(!exact) {
    const HParams& h = h_;
    layout_ = device_arena(h, plan_.max_batch, plan_.n_ff_dense);
    kv_layer_floats_ = plan_.n_ctx * h.n_embd_kv();

    // Weights: one allocation in the file's types (cuda_backend.cuh DeviceWeights; streamed: every
    // tensor but the stacked experts, which the VRAM tier's slots hold).
    std::vector<HostWeight> host = device_weights(model);
    if (streamed != nullptr)
        host.erase(std::remove_if(host.begin(), host.end(), [](const HostWeight& w) { return w.expert; }),
                   host.end());
    weights_ = DeviceWeights(host, stream_, "weights of " + h.arch);
    kv_ = DeviceBuffer(plan_.kv_bytes, "KV cache");
    arena_ = DeviceBuffer(layout_.total, "activations");
    ids_host_ = PinnedBuffer(sizeof(int32_t) * plan_.max_batch * h.n_expert_used, "expert ids");
    logits_host_ = PinnedBuffer(sizeof(float) * plan_.max_batch * h.n_vocab, "logits");

    token_embd_ = device_of(model.token_embd.data);
    output_norm_ = static_cast<const float*>(device_of(model.output_norm.data()));
    output_ = linear_of(model.output);
    for (int il = 0; il < h.n_layer; ++il) {
        const LayerWeights& L = model.layers[static_cast<size_t>(il)];
        DeviceLayer d;
        d.attn_norm = static_cast<const float*>(device_of(L.attn_norm.data()));
        d.wq = linear_of(L.wq.w, &L.wq.bias);
        d.wk = linear_of(L.wk.w, &L.wk.bias);
        d.wv = linear_of(L.wv.w, &L.wv.bias);
        d.wo = linear_of(L.wo.w, &L.wo.bias);
        if (!L.attn_q_norm.empty()) {
            // qwen3moe: weights of head_dim, one norm per head; olmoe: over the whole projection.
            const bool per_head = static_cast<int64_t>(L.attn_q_norm.size()) == h.head_dim;
            d.qk_norm = per_head ? QkNormKind::per_head : QkNormKind::full;
            d.q_norm = static_cast<const float*>(device_of(L.attn_q_norm.data()));
            d.k_norm = static_cast<const float*>(device_of(L.attn_k_norm.data()));
        }
        d.ffn_norm = static_cast<const float*>(device_of(L.ffn_norm.data()));
        const ExpertLayerLayout& e = model.experts.layers[static_cast<size_t>(il)];
        d.moe = e.present();
        if (d.moe) {
            d.router = linear_of(L.ffn_gate_inp);
            const ExpertPart& g = e.parts[kExpertGate];
            const ExpertPart& u = e.parts[kExpertUp];
            const ExpertPart& dn = e.parts[kExpertDown];
            // Streamed: the stacked pointers stay null; the slot table supplies each expert's rows.
            const bool stacked = streamed == nullptr;
            d.experts = ExpertWeights{stacked ? device_of(g.view.data) : nullptr,
                                      stacked ? device_of(u.view.data) : nullptr,
                                      stacked ? device_of(dn.view.data) : nullptr,
                                      g.view.type,
                                      u.view.type,
                                      dn.view.type,
                                      h.n_embd,
                                      h.n_ff_exp,
                                      ExpertActivation{}};  // SwiGLU: device_plan refuses the others
            // The planner's bound holds the real scratch of the fused FFN (expert_ffn.cu's carve).
            if (expert_ffn_scratch_bytes(d.experts, plan_.max_batch, h.n_expert_used, int8_) >
                layout_.expert_scratch_bytes) {
                throw DeviceError(
                    "[cuda] device plan: the expert scratch bound is below the fused FFN's need");
            }
        }
        d.ffn_gate = linear_of(L.ffn_gate.w, &L.ffn_gate.bias);
        d.ffn_up = linear_of(L.ffn_up.w, &L.ffn_up.bias);
        d.ffn_down = linear_of(L.ffn_down.w, &L.ffn_down.bias);
        d.shexp_gate = linear_of(L.ffn_gate_inp_shexp);
        layers_.push_back(d);
    }
    if (streamed != nullptr) {
        if (h.n_expert_used > kMaxSlotTable) {
            throw UnsupportedError("[cuda] streamed experts: top-" + std::to_string(h.n_expert_used) +
                                   " is above the slot table's " + std::to_string(kMaxSlotTable));
        }
        cache_ = std::make_unique<ExpertCache>(model.experts, *streamed,
                                               vram_tier(model.experts, streamed->reader, &fills_));
        gate_host_ = PinnedBuffer(sizeof(float) * (h.n_embd + h.n_expert), "gate inputs");
        if (misses != nullptr && misses->mode != MissMode::copy) open_cpu_misses(*misses);
    }
    stream_.synchronize("upload of " + h.arch + " to the device");
}

const void* CudaForward::device_of(const void* host) const {
    return weights_.device_of(host, "a tensor the layer loop reads");
}

DeviceLinear CudaForward::linear_of(const WeightView& w, const std::vector<float>* bias) const {
    DeviceLinear l;
    if (w.data == nullptr) return l;
    l.w = device_of(w.data);
    l.type = w.type;
    l.n_out = w.n_rows;
    l.n_in = w.n_cols;
    if (bias != nullptr && !bias->empty()) l.bias = static_cast<const float*>(device_of(bias->data()));
    return l;
}

void CudaForward::linear(const DeviceLinear& l, const float* x, int64_t n_tokens, float* y) const {
    launch_linear(l.type, l.w, l.n_out, l.n_in, x, n_tokens, int8_, arena(layout_.xq), y, stream_.get());
    if (l.bias != nullptr) launch_add_bias(y, l.bias, n_tokens, l.n_out, stream_.get());
}

// down(silu(gate x) * up x), as Forward::ffn.
void CudaForward::dense_ffn(const DeviceLayer& L, const float* x, int64_t n_tokens, float* y) const {
    float* g = arena(layout_.ffn_g);
    float* u = arena(layout_.ffn_u);
    linear(L.ffn_gate, x, n_tokens, g);
    linear(L.ffn_up, x, n_tokens, u);
    launch_silu_mul(g, u, n_tokens * L.ffn_gate.n_out, u, stream_.get());
    linear(L.ffn_down, u, n_tokens, y);
}

void CudaForward::set_timeline(Timeline* timeline) {
    if (timeline == nullptr || !timeline->enabled()) return;
    clock_ = std::make_unique<DeviceClock>();
    stream_.synchronize("timeline clock");
    clock_->ref.record(stream_);
    clock_->ref.synchronize();
    clock_->ref_us = timeline->now_us();
    layer_begin_.clear();
    layer_end_.clear();
    for (int il = 0; il < h_.n_layer; ++il) {
        layer_begin_.emplace_back(true);
        layer_end_.emplace_back(true);
    }
    timeline_ = timeline;
    if (fills_ != nullptr) fills_->set_timeline(timeline, clock_.get());
}

// Host -> device speed of the copy path: one expert's three parts (expert 0 of the first MoE layer) from
// the mapping (pinned by the VRAM tier's filler) into device scratch, timed with events on a fresh
// stream, median of 3; latency: a 256-byte copy, median of 3.
struct CopySpeed {
    double bytes_per_s = 0.0, latency_s = 0.0;
};

CopySpeed measure_copy_speed(const Model& model) {
    const ExpertLayout& layout = model.experts;
    const auto first = std::find_if(layout.layers.begin(), layout.layers.end(),
                                    [](const ExpertLayerLayout& x) { return x.present(); });
    const ExpertLayerLayout& x = *first;
    uint64_t total = 0;
    for (const ExpertPart& part : x.parts) total += part.bytes;
    DeviceBuffer dst(total, "copy speed probe");
    Stream stream;
    cudaEvent_t t0 = nullptr, t1 = nullptr;
    cuda_check(cudaEventCreate(&t0), "cudaEventCreate (copy speed)");
    cuda_check(cudaEventCreate(&t1), "cudaEventCreate (copy speed)");
    const auto timed = [&](bool whole) {
        cuda_check(cudaEventRecord(t0, stream.get()), "cudaEventRecord");
        uint64_t at = 0;
        for (const ExpertPart& part : x.parts) {
            const uint64_t n = whole ? part.bytes : std::min<uint64_t>(part.bytes, 256);
            cuda_check(cudaMemcpyAsync(dst.as<uint8_t>() + at, part.view.data, n, cudaMemcpyHostToDevice,
                                       stream.get()),
                       "copy speed probe");
            at += n;
            if (!whole) break;
        }
        cuda_check(cudaEventRecord(t1, stream.get()), "cudaEventRecord");
        cuda_check(cudaEventSynchronize(t1), "cudaEventSynchronize (copy speed)");
        float ms = 0.0f;
        cuda_check(cudaEventElapsedTime(&ms, t0, t1), "cudaEventElapsedTime");
        return std::max(static_cast<double>(ms) * 1e-3, 1e-9);
    };
    const auto median3 = [&](bool whole) {
        timed(whole);  // untimed warm-up
        double s[3] = {timed(whole), timed(whole), timed(whole)};
        std::sort(s, s + 3);
        return s[1];
    };
    CopySpeed out;
    out.latency_s = median3(false);
    out.bytes_per_s = static_cast<double>(total) / median3(true);
    cudaEventDestroy(t0);
    cudaEventDestroy(t1);
    return out;
}

void CudaForward::open_cpu_misses(const CpuMissOptions& misses) {
    if (misses.pool == nullptr)
        throw InvalidArgument("[cuda] CPU compute of misses needs the session's pool");
    misses_ = misses;
    host_experts_ = std::make_unique<ResidentExperts>(model_.experts);
    cpu_x_ = PinnedBuffer(sizeof(float) * h_.n_embd, "CPU expert input");
    cpu_rows_ = PinnedBuffer(sizeof(float) * h_.n_expert_used * h_.n_embd, "CPU expert outputs");
    if (misses_.mode != MissMode::cost) return;
    if (misses_.copy_bytes_per_s <= 0.0 || misses_.copy_latency_s < 0.0) {
        const CopySpeed c = measure_copy_speed(model_);
        if (misses_.copy_bytes_per_s <= 0.0) misses_.copy_bytes_per_s = c.bytes_per_s;
        if (misses_.copy_latency_s < 0.0) misses_.copy_latency_s = c.latency_s;
    }
    if (misses_.cpu_bytes_per_s <= 0.0)
        misses_.cpu_bytes_per_s = measure_cpu_expert_speed(model_.experts, h_.n_embd, *misses_.pool, !int8_);
}

// Releases the layer's slots on every exit path; on the normal one after compute_done marked the end
// of the reads (a slot may be refilled only after the kernels that read it ran).
struct SlotLease {
    ExpertCache& cache;
    VramFills& fills;
    cudaStream_t stream;
    int il;  // -1: nothing to release
    ~SlotLease() {
        if (il < 0) return;  // nothing acquired (every expert of the layer went to the CPU)
        try {
            fills.compute_done(stream);
        } catch (...) {  // a lost context: the error resurfaces at the next checked call
        }
        cache.release(il);
    }
};

void CudaForward::streamed_experts(int il, const DeviceLayer& L, int64_t T, const float* cur,
                                   const float* ffn_inp, const float* router_logits, const int32_t* ids,
                                   const float* weights, float* out, GateObserver* observer) {
    const cudaStream_t s = stream_.get();
    const int64_t k = h_.n_expert_used;
    void* scratch = arena<void>(layout_.experts);
    // The one host wait of the layer: the cache decides on the host which copies the kernels need.
    int32_t* ids_host = ids_host_.as<int32_t>();
    copy_to_host(ids_host, ids, sizeof(int32_t) * T * k, stream_, "expert ids");
    float* hidden_host = gate_host_.as<float>();
    float* logits_host = hidden_host + h_.n_embd;
    if (observer != nullptr) {
        copy_to_host(hidden_host, ffn_inp, sizeof(float) * h_.n_embd, stream_, "gate hidden state");
        copy_to_host(logits_host, router_logits, sizeof(float) * h_.n_expert, stream_, "router logits");
    }
    stream_.synchronize("expert ids of layer " + std::to_string(il));
    std::vector<int32_t> unique(ids_host, ids_host + T * k);
    std::sort(unique.begin(), unique.end());
    unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
    cache_->gate_fired(il, unique.data(), static_cast<int>(unique.size()));
    std::vector<ExpertView> views;
    if (T == 1) {
        // Misses the mode sends to the CPU stay out of the cache; the rest is acquired as always.
        std::vector<int32_t> on_device, on_cpu;
        if (host_experts_) {
            std::vector<bool> present(unique.size());
            for (size_t i = 0; i < unique.size(); ++i) present[i] = cache_->present(il, unique[i]);
            MissCostInputs in;
            in.expert_bytes = cache_->expert_bytes(il);
            in.n_embd = h_.n_embd;
            in.copy_bytes_per_s = misses_.copy_bytes_per_s;
            in.copy_latency_s = misses_.copy_latency_s;
            in.cpu_bytes_per_s = misses_.cpu_bytes_per_s;
            const std::vector<MissRoute> routes = route_misses(misses_.mode, present, in);
            for (size_t i = 0; i < unique.size(); ++i)
                (routes[i] == MissRoute::cpu ? on_cpu : on_device).push_back(unique[i]);
        } else {
            on_device = unique;
        }
        const int n = static_cast<int>(on_device.size());
        views.resize(on_device.size());
        if (n > 0) cache_->acquire(il, on_device.data(), n, views.data());
        SlotLease lease{*cache_, *fills_, s, n > 0 ? il : -1};
        // The layer's copies are out: prefetches the observer starts queue behind them.
        if (observer != nullptr) observer->on_gate(il, 1, hidden_host, logits_host, ids_host);
        if (n > 0) stream_wait_acquired(*cache_, *fills_, n, s);
        ExpertSlotTable table{};
        if (!on_cpu.empty()) {
            // The CPU computes its experts from the mapping while the device waits on the row copies.
            copy_to_host(cpu_x_.as<float>(), cur, sizeof(float) * h_.n_embd, stream_, "CPU expert input");
            stream_.synchronize("CPU expert input of layer " + std::to_string(il));
            table.cpu_rows = cpu_rows_.as<float>();
        }
        for (int64_t slot = 0; slot < k; ++slot) {
            const int32_t e = ids_host[slot];
            if (std::binary_search(on_cpu.begin(), on_cpu.end(), e)) {
                ExpertView v;
                host_experts_->acquire(il, &e, 1, &v);
                const ExpertFfnWeights w{v.gate, v.up, v.down};
                const float one = 1.0f;
                cpu::expert_ffn_one_token(*misses_.pool, &w, &one, 1, cpu_x_.as<float>(),
                                          cpu_rows_.as<float>() + slot * h_.n_embd, !int8_);
                table.cpu_mask |= 1u << slot;
                ++cpu_experts_;
                continue;
            }
            const auto at = std::lower_bound(on_device.begin(), on_device.end(), e) - on_device.begin();
            const ExpertView& v = views[static_cast<size_t>(at)];
            table.gate[slot] = v.gate.data;
            table.up[slot] = v.up.data;
            table.down[slot] = v.down.data;
        }
        launch_expert_ffn_decode_slots(L.experts, table, cur, weights, k, int8_, scratch, out, s);
        return;
    }
    // Prefill: the batch's experts in waves the cache can hold at once, one group per expert.
    GroupedExpertFfn grouped(L.experts, cur, T, ids_host, k, int8_, scratch, s);
    const size_t wave = static_cast<size_t>(std::max(1, cache_->max_acquire()));
    for (size_t w0 = 0; w0 < unique.size(); w0 += wave) {
        const int n = static_cast<int>(std::min(wave, unique.size() - w0));
        views.assign(static_cast<size_t>(n), ExpertView{});
        cache_->acquire(il, unique.data() + w0, n, views.data());
        SlotLease lease{*cache_, *fills_, s, il};
        stream_wait_acquired(*cache_, *fills_, n, s);
        for (int i = 0; i < n; ++i)
            grouped.run_expert(unique[w0 + static_cast<size_t>(i)], views[i].gate.data, views[i].up.data,
                               views[i].down.data);
    }
    grouped.combine(weights, out);
}

void CudaForward::layer(int il, int64_t T, int64_t pos, GateObserver* observer) {
    const HParams& h = h_;
    const DeviceLayer& L = layers_[static_cast<size_t>(il)];
    const cudaStream_t s = stream_.get();
    const int64_t E = h.n_embd, n_q = h.n_embd_q(), n_kv = h.n_embd_kv(), hd = h.head_dim;
    const int64_t k = h.n_expert_used;
    float* x = arena(layout_.x);
    float* cur = arena(layout_.cur);
    float* q = arena(layout_.q);
    float* attn = arena(layout_.attn);
    float* tmp = arena(layout_.tmp);
    float* ffn_inp = arena(layout_.ffn_inp);

    // Attention. K and V are projected straight into their cache rows; q/k norm and RoPE run there.
    launch_rms_norm(x, L.attn_norm, T, E, h.rms_eps, cur, s);
    float* k_new = k_cache(il) + pos * n_kv;
    float* v_new = v_cache(il) + pos * n_kv;
    linear(L.wq, cur, T, q);
    linear(L.wk, cur, T, k_new);
    linear(L.wv, cur, T, v_new);
    if (L.qk_norm == QkNormKind::per_head) {
        launch_rms_norm(q, L.q_norm, T * h.n_head, hd, h.rms_eps, q, s);
        launch_rms_norm(k_new, L.k_norm, T * h.n_head_kv, hd, h.rms_eps, k_new, s);
    } else if (L.qk_norm == QkNormKind::full) {
        launch_rms_norm(q, L.q_norm, T, n_q, h.rms_eps, q, s);
        launch_rms_norm(k_new, L.k_norm, T, n_kv, h.rms_eps, k_new, s);
    }
    const DeviceRope rope = device_rope(h.rope, nullptr);  // device_plan refuses frequency factors here
    launch_rope(q, n_q, T, h.n_head, hd, pos, rope, s);
    launch_rope(k_new, n_kv, T, h.n_head_kv, hd, pos, rope, s);
    launch_attention(q, k_cache(il), v_cache(il), T, pos, h.n_head, h.n_head_kv, hd,
                     1.0f / std::sqrt(static_cast<float>(hd)), attn, s);
    linear(L.wo, attn, T, tmp);
    launch_add(tmp, x, T * E, ffn_inp, s);

    // FFN: routed experts (+ the shared expert), or the dense FFN.
    launch_rms_norm(ffn_inp, L.ffn_norm, T, E, h.rms_eps, cur, s);
    if (L.moe) {
        float* logits = arena(layout_.router);
        int32_t* ids = arena<int32_t>(layout_.routing) + static_cast<int64_t>(il) * plan_.max_batch * k;
        float* weights = arena(layout_.weights);
        linear(L.router, cur, T, logits);
        DeviceRouterSpec router;  // softmax top-k: device_plan.cpp refuses the other routers here
        router.normalize = h.router.normalize_topk;
        launch_router_topk(logits, T, h.n_expert, k, router, ids, weights, s);
        void* scratch = arena<void>(layout_.experts);
        if (cache_) {
            streamed_experts(il, L, T, cur, ffn_inp, logits, ids, weights, tmp, observer);
        } else if (T == 1) {
            launch_expert_ffn_decode(L.experts, cur, ids, weights, k, int8_, scratch, tmp, s);
        } else {
            int32_t* ids_host = ids_host_.as<int32_t>();
            copy_to_host(ids_host, ids, sizeof(int32_t) * T * k, stream_, "expert ids");
            stream_.synchronize("expert ids of layer " + std::to_string(il));
            launch_expert_ffn_grouped(L.experts, cur, T, ids_host, weights, k, int8_, scratch, tmp, s);
        }
        if (L.ffn_gate.present()) {
            float* shared = arena(layout_.ffn_out);
            dense_ffn(L, cur, T, shared);
            if (L.shexp_gate.present()) {
                float* gate = arena(layout_.shexp_gate);
                linear(L.shexp_gate, cur, T, gate);
                launch_sigmoid_scale(shared, gate, T, E, s);
            }
            launch_add(tmp, shared, T * E, tmp, s);
        }
    } else {
        dense_ffn(L, cur, T, tmp);
    }
    launch_add(tmp, ffn_inp, T * E, x, s);
}

void CudaForward::chunk(const int32_t* tokens, int64_t T, int64_t pos, int64_t first_logit_row, float* logits,
                        std::vector<std::vector<int32_t>>& routing,
                        const std::function<void(int)>& check_cancel, GateObserver* observer) {
    const HParams& h = h_;
    const cudaStream_t s = stream_.get();
    const int64_t E = h.n_embd, k = h.n_expert_used;
    float* x = arena(layout_.x);
    const size_t embd_row = model_.token_embd.row_bytes;
    for (int64_t t = 0; t < T; ++t) {
        const void* row =
            static_cast<const unsigned char*>(token_embd_) + static_cast<size_t>(tokens[t]) * embd_row;
        launch_dequantize(model_.token_embd.type, row, x + t * E, E, s);
    }
    const bool timed = timeline_ != nullptr;
    for (int il = 0; il < h.n_layer; ++il) {
        if (check_cancel) check_cancel(il);
        if (timed) layer_begin_[static_cast<size_t>(il)].record(stream_);
        layer(il, T, pos, observer);
        if (timed) layer_end_[static_cast<size_t>(il)].record(stream_);
    }
    const int64_t n_out = T - first_logit_row;
    if (n_out > 0) {
        float* cur = arena(layout_.cur);
        float* out = arena(layout_.logits);
        launch_rms_norm(x + first_logit_row * E, output_norm_, n_out, E, h.rms_eps, cur, s);
        linear(output_, cur, n_out, out);
        copy_to_host(logits_host_.data(), out, sizeof(float) * n_out * h.n_vocab, stream_, "logits");
    }
    // Every layer's ids, one strided copy: [n_layer, max_batch * k] on the device -> [n_layer, T * k].
    // Queued after the logits (a pageable destination makes the call wait for the stream).
    std::vector<int32_t> ids(static_cast<size_t>(h.n_layer * T * k));
    cuda_check(cudaMemcpy2DAsync(ids.data(), sizeof(int32_t) * T * k, arena<int32_t>(layout_.routing),
                                 sizeof(int32_t) * plan_.max_batch * k, sizeof(int32_t) * T * k,
                                 static_cast<size_t>(h.n_layer), cudaMemcpyDeviceToHost, s),
               "copy to host: routing");
    stream_.synchronize("forward pass of " + std::to_string(T) + " tokens at position " +
                        std::to_string(pos));
    if (n_out > 0) {
        const float* src = logits_host_.as<float>();
        std::copy(src, src + n_out * h.n_vocab, logits);
    }
    for (int il = 0; timed && il < h.n_layer; ++il) {
        const size_t i = static_cast<size_t>(il);
        timeline_->span("compute stream", "layer " + std::to_string(il), clock_->host_us(layer_begin_[i]),
                        clock_->host_us(layer_end_[i]));
    }
    for (int il = 0; il < h.n_layer; ++il) {
        if (!layers_[static_cast<size_t>(il)].moe) continue;  // no router: nothing was written
        const int32_t* row = ids.data() + static_cast<int64_t>(il) * T * k;
        std::vector<int32_t>& r = routing[static_cast<size_t>(il)];
        r.insert(r.end(), row, row + T * k);
    }
}

void CudaForward::forward(const int32_t* tokens, int64_t n_tokens, int64_t pos0, bool all_logits,
                          float* logits, std::vector<std::vector<int32_t>>& routing,
                          const std::function<void(int)>& check_cancel, GateObserver* observer) {
    const int64_t B = plan_.max_batch;
    routing.assign(static_cast<size_t>(h_.n_layer), {});
    for (int64_t c0 = 0; c0 < n_tokens; c0 += B) {
        const int64_t T = std::min(B, n_tokens - c0);
        const bool last = c0 + T == n_tokens;
        // Rows of this chunk whose logits are wanted (all, or the last of the last chunk; none else).
        const int64_t first = all_logits ? 0 : (last ? T - 1 : T);
        float* dst = all_logits ? logits + c0 * h_.n_vocab : logits;
        chunk(tokens + c0, T, pos0 + c0, first, dst, routing, check_cancel,
              n_tokens == 1 ? observer : nullptr);
    }
}

}  // namespace

std::unique_ptr<DeviceForward> open_device_forward(const Model& model, int64_t n_ctx, int64_t max_batch,
                                                   GgmlType type_k, GgmlType type_v, bool exact,
                                                   const ExpertCacheOptions* streamed,
                                                   const CpuMissOptions* misses) {
    const HParams& h = model.hp;
    const std::string what = "device=\"cuda\" for " + h.arch;
    require_device(what);
    DevicePlan plan = plan_device_model(model, n_ctx, max_batch, type_k, type_v);
    if (streamed != nullptr) {
        // The experts the plan would upload are VRAM slots instead (their bytes: the cache's arena).
        plan.uploads.erase(std::remove_if(plan.uploads.begin(), plan.uploads.end(),
                                          [](const DeviceUpload& u) { return u.expert; }),
                           plan.uploads.end());
        plan.expert_bytes =
            (streamed->n_slots + streamed->n_staging) * ExpertCache::slot_bytes(model.experts);
    }
    const DeviceInfo info = device_info();
    const uint64_t need = plan.total_bytes(), mib = 1ull << 20;
    if (!info.present || need > info.vram_free) {
        throw InvalidArgument(
            "[cuda] " + what + ": dense weights " + std::to_string(plan.dense_bytes / mib) +
            " MiB + experts " + std::to_string(plan.expert_bytes / mib) + " MiB + KV cache " +
            std::to_string(plan.kv_bytes / mib) + " MiB (n_ctx " + std::to_string(n_ctx) + ") + buffers " +
            std::to_string(plan.buffer_bytes / mib) + " MiB = " + std::to_string(need / mib) +
            " MiB do not fit the " + std::to_string(info.vram_free / mib) + " MiB free on " + info.name +
            " (a smaller n_ctx shrinks the KV cache; use device=\"cpu\")");
    }
    return std::make_unique<CudaForward>(model, std::move(plan), exact, streamed, misses);
}

}  // namespace sharpi::cuda
