// RecordingBackend: a Backend that runs every op on another backend and records the call (op name,
// the weight or cache type it reads, the variant of the op it needs). The host test of the one
// forward pass (tests/test_backend_ops.py) runs each architecture through it on the CPU and checks
// every recorded call against what the CUDA backend implements (backend/cuda_interface.h
// unsupported_op), so a GPU-less machine still shows which architectures the device can run and
// which op stops the others, by name.
#pragma once

#include <vector>

#include "backend/backend.h"
#include "backend/op_call.h"

namespace sharpi {

class RecordingBackend final : public Backend {
  public:
    explicit RecordingBackend(Backend& inner) : inner_(inner) {}
    const std::vector<OpCall>& calls() const { return calls_; }
    // Every weight an op named by its host address (WeightView.data, an f32 vector's data, an
    // expert's bytes), in call order: what a device backend must find uploaded.
    const std::vector<WeightRead>& weight_reads() const { return weight_reads_; }

    const char* name() const override { return inner_.name(); }
    bool host_memory() const override { return inner_.host_memory(); }

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
    void record(const char* op, GgmlType type = GgmlType::F32, std::string variant = "");
    // One call per distinct (projection type, variant) of the given experts.
    void record_experts(const char* op, const ExpertFfnWeights* experts, int64_t n, bool exact);

    void read_weight(const char* op, const void* data);
    void read_experts(const char* op, const ExpertFfnWeights* experts, int64_t n);

    Backend& inner_;
    std::vector<OpCall> calls_;
    std::vector<WeightRead> weight_reads_;
};

}  // namespace sharpi
