// The CPU backend: backend/backend.h's ops on the kernels of cpu/ops, activations in a host Scratch
// arena, parallel work on the session's thread pool. Every op is the kernel call (or the loop) the
// layer builders made before the interface existed, in the same order, so its output is bit for bit
// what it was (tools/compare_logits.py checks that against an older build).
#pragma once

#include <vector>

#include "backend/backend.h"
#include "threads/thread_pool.h"

namespace sharpi {

class CpuBackend final : public Backend {
  public:
    CpuBackend(ThreadPool& pool, Scratch& scratch) : pool_(pool), scratch_(scratch) {}

    const char* name() const override { return "cpu"; }
    bool host_memory() const override { return true; }
    // The session's pool, for architecture code that computes on host rows itself (deepseek4's
    // compressed attention): work split over it must give the same bits however it is cut.
    ThreadPool& pool() { return pool_; }

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
    ThreadPool& pool_;
    Scratch& scratch_;
    std::vector<float> residual_;
};

}  // namespace sharpi
