// The CUDA backend: backend/backend.h's ops launched with the kernels of cuda/ops, so the layer
// builders (model/forward.h, the architecture files, moe/moe_ffn.h) run on the device as they run
// on the CPU. The core reaches it through backend/cuda_interface.h make_cuda_backend.
//
// Owns (docs/style.md habit 6):
// - the weights: every tensor of device_weights(model) (device_plan.h), uploaded once at
//   construction into one allocation in the file's types (DeviceWeights). An op names a weight by its
//   host address (WeightView.data, an f32 vector's data(), an expert's bytes inside a stacked tensor)
//   and the backend maps it to the device copy through the ordered map of upload ranges.
// - the activations: a device arena (bump allocation in blocks; reset_activations frees every block
//   but one, grown to what the last layer took, so a steady state allocates nothing), plus one
//   residual buffer that outlives the resets. Every Act and `float*` an op takes is device memory.
// - the KV cache: its own f32 K and V per layer on the device, [n_ctx, row width] each, allocated at
//   a layer's first kv_store from the KvCache's shape (n_ctx(), row_width(), type_k/type_v). The
//   KvCache's host buffers are never read or written, so a device session needs only its shape; until
//   the engine builds a shape-only cache, it must size the host KvCache as it does for the CPU (same
//   n_ctx, width and f32 types) and pay its host memory. One backend serves one sequence: a KvCache of
//   another shape reallocates (and forgets) the device rows of that layer.
// - one compute stream: every op is queued on it; the host waits only in read() (the caller wants
//   host data) and route_topk (the host schedules the experts on the ids: one wait per MoE layer).
//
// Support: every op first asks the support table (backend/cuda_interface.h unsupported_op) about the
// OpCall RecordingBackend would record (backend/op_call.h builds both) and throws UnsupportedError
// "[cuda] <the table's text>" before anything is queued. Single-threaded, like the engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/op_call.h"
#include "device_memory.cuh"
#include "device_plan.h"
#include "ops/expert_ffn.cuh"

namespace sharpi {
struct Model;
}  // namespace sharpi

namespace sharpi::cuda {

// Host tensors copied to VRAM, one allocation, each at a 256-byte aligned offset, and the map from a
// host address to its device copy. Shared by the CUDA backend and the device forward pass
// (device_forward.cu).
class DeviceWeights {
  public:
    DeviceWeights() = default;
    // Queues every copy on `stream` (pageable sources are staged before the call returns); the caller
    // synchronizes the stream before the weights are read.
    DeviceWeights(const std::vector<HostWeight>& host, const Stream& stream, const std::string& what);
    // The device address of a host address inside an upload (its first byte or any byte within:
    // expert e of a stacked tensor is base + e * bytes). nullptr for nullptr; DeviceError naming
    // `what` for an address outside every upload.
    const void* device_of(const void* host, const std::string& what) const;
    uint64_t bytes() const { return buffer_.size(); }

  private:
    struct Range {
        const unsigned char* host_end;
        unsigned char* device;
    };
    DeviceBuffer buffer_;
    std::map<const unsigned char*, Range> ranges_;  // by host begin
};

class CudaBackend final : public Backend {
  public:
    // Uploads device_weights(model) and waits for the copies. The caller checked for a device
    // (make_cuda_backend: require_device), as the stream is created first.
    explicit CudaBackend(const Model& model);

    const char* name() const override { return "cuda"; }
    bool host_memory() const override { return false; }

    Act alloc(int64_t n_tokens, int64_t width) override;
    void reset_activations() override;
    Act residual(int64_t n_tokens, int64_t width) override;
    void read(const Act& x, float* host) override;
    void copy(const Act& src, const Act& dst) override;
    void copy_rows(const float* src, int64_t ld_src, float* dst, int64_t ld_dst, int64_t n_rows,
                   int64_t width) override;

    void get_rows(const WeightView& table, const token_t* tokens, const Act& x) override;
    void rms_norm(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t n_rows, int64_t width,
                  const float* weight, float eps) override;
    void matmul(const WeightView& w, const float* x, int64_t ldx, int64_t n_tokens, float* y, int64_t ldy,
                bool exact) override;
    void add_bias(const Act& y, const float* bias) override;
    void add(const Act& a, const Act& b, const Act& y) override;
    void swiglu(const float* gate, const float* up, float* out, int64_t n) override;
    void mul_sigmoid(float* x, const float* gate, int64_t n) override;
    void mul_silu(float* x, const float* z, int64_t n) override;
    void relu_sqr(const float* x, float* out, int64_t n) override;
    void scale_rows_sigmoid(const Act& x, const Act& s) override;
    void scale_rows(const Act& x, const float* scales) override;
    void layer_norm(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t n_rows, int64_t width,
                    const float* weight, const float* bias, float eps) override;
    void rope(float* x, int64_t ld, int64_t n_tokens, int64_t n_heads, int64_t head_dim, int64_t pos0,
              const RopeParams& p) override;

    void kv_store(KvCache& kv, int il, int64_t pos0, const Act& k, const Act* v) override;
    void attention(const float* q, int64_t ldq, const KvCache& kv, int il, int64_t n_tokens, int64_t pos0,
                   const AttentionShape& shape, float* out, int64_t ldo) override;
    void mla_attention(const float* q_abs, int64_t ldq, const KvCache& kv, int il, int64_t n_tokens,
                       int64_t pos0, const MlaShape& shape, const MlaSelection* selection, float* out,
                       int64_t ldo) override;
    void lightning_indexer(const float* q, int64_t ldq, const float* w, int64_t ldw, const KvCache& kv,
                           int il, int64_t n_tokens, int64_t pos0, const IndexerShape& shape,
                           int32_t* positions, int32_t* count) override;

    void gdn_gates(const Act& b, const Act& a, const float* ssm_a, const float* dt_bias, const Act& beta,
                   const Act& g) override;
    void conv1d_silu(float* state, const float* x, int64_t ldx, int64_t n_tokens, int64_t channels,
                     int64_t kernel_size, const float* kernel, const float* bias, float* y,
                     int64_t ldy) override;
    void l2_norm_heads(const Act& x, int64_t n_heads, int64_t head_dim, int64_t n_scaled,
                       float scale) override;
    void gated_delta_rule(const GdnInputs& in, int64_t n_tokens, const GdnShape& shape, int64_t chunk_size,
                          float* state, float* out, int64_t ldo) override;
    void rms_norm_unweighted(const float* x, float* y, int64_t ld, int64_t n_rows, int64_t width,
                             float eps) override;
    void swiglu_clamped(const float* gate, const float* up, float* out, int64_t n, float limit) override;
    void hc_block_weights(const float* mixes, int64_t n_tokens, int64_t n_hc, const float* base,
                          const float* scale, float eps, int64_t sinkhorn_iters, float* pre, float* post,
                          float* comb) override;
    void hc_head_weights(const float* mixes, int64_t n_tokens, int64_t n_hc, const float* base,
                         const float* scale, float eps, float* pre) override;
    void hc_collapse(const float* x, int64_t n_tokens, int64_t n_hc, int64_t d, const float* pre,
                     float* y) override;
    void hc_expand(const float* x, const float* out, int64_t n_tokens, int64_t n_hc, int64_t d,
                   const float* post, const float* comb, float* y) override;
    void compressed_attention(const CompressedAttentionInputs& in, KvCache& kv, int il, int64_t n_tokens,
                              int64_t pos0, const CompressedAttentionShape& shape, float* out,
                              int64_t ldo) override;
    void ssm_scan(const SsmInputs& in, int64_t n_tokens, const SsmShape& shape, float* state, float* out,
                  int64_t ldo) override;

    void route_topk(const Act& logits, int64_t k, const RouterParams& params, const Act& probs, int32_t* ids,
                    float* weights) override;
    void topk_weights(const float* probs, const int32_t* ids, int64_t k, const RouterParams& params,
                      float* weights) override;
    void expert_ffn_one_token(const ExpertFfnWeights* experts, const float* weights, int k, const float* x,
                              float* out, bool exact) override;
    void expert_ffn_slots(const ExpertFfnWeights* experts, const int64_t* slots, int64_t n_slots,
                          const float* x, const Act& y, bool exact) override;
    void expert_ffn_batch(const ExpertFfnWeights* experts, const int64_t* member_begin,
                          const int64_t* member_end, int n_experts, const int64_t* tokens, const float* x,
                          int64_t ldx, float* y, int64_t ldy, bool exact) override;
    void moe_combine(const Act& y, const int64_t* member_of, const float* weights, int64_t k,
                     const Act& out) override;

  private:
    // The device K and V rows of one layer ([n_ctx, width] f32 each; V absent until stored).
    struct LayerKv {
        DeviceBuffer k, v;
        int64_t n_ctx = 0, width = 0;
    };

    // UnsupportedError "[cuda] " + unsupported_op(call) when the table refuses the call.
    void check(const OpCall& call) const;
    void check(const std::vector<OpCall>& calls) const;
    // For the ops the table lists as missing: throws its error (DeviceError should the table ever
    // list one of them without a launch here).
    [[noreturn]] void refuse(const OpCall& call) const;

    const void* weight(const void* host, const char* op) const;
    const float* weight_f32(const float* host, const char* op) const;
    void set_slot(ExpertSlotTable& table, int j, const ExpertFfnWeights& e, const char* op) const;
    // Arena scratch valid until reset_activations, 256-byte aligned.
    void* take(size_t bytes);
    float* take_floats(int64_t n) {
        return static_cast<float*>(take(sizeof(float) * static_cast<size_t>(n)));
    }
    // Host values copied into fresh arena scratch (queued on the stream; the source may go at return).
    template <typename T>
    T* upload(const T* host, int64_t n, const char* what);
    // dst rows = src rows, `width` floats each, with their own strides (device to device, queued).
    void copy_2d(const float* src, int64_t ld_src, float* dst, int64_t ld_dst, int64_t n_rows, int64_t width,
                 const char* what);
    LayerKv& layer_kv(const KvCache& kv, int il);

    const Model& model_;
    Stream stream_;
    DeviceWeights weights_;
    std::vector<DeviceBuffer> arena_;  // blocks; the last one is being carved
    size_t arena_used_ = 0;            // bytes taken from the last block
    size_t arena_total_ = 0;           // bytes taken from every block since the last reset
    DeviceBuffer residual_;
    std::vector<LayerKv> kv_;
    DeviceBuffer one_;  // a single 1.0f: expert_ffn_slots' unit weight
};

}  // namespace sharpi::cuda
