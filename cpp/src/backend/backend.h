// Backend: the ops the layer builders (model/forward.h, model/hybrid_layer.cpp, the architecture
// files) and the MoE FFN (moe/moe_ffn.h) compute with, over activations that live on the backend.
// There is one forward pass: the builders call only this interface, and each backend implements
// every op with its own kernels (cpu/cpu_backend.h over cpu/ops; the CUDA backend over cuda/ops).
// An op a backend cannot run for the given types or shapes throws UnsupportedError naming the
// backend, the op and the type, before anything is computed.
//
// Naming: one name per op, the same as the kernel file on each side (cpu/ops/rms_norm.h,
// cuda/ops/rms_norm.cuh). Adding an op is one virtual here, one row in backend/op_names.h's table,
// and its implementation in each backend.
//
// Memory: an Act's data and every `float*` an op takes are backend memory (host memory for the CPU
// backend), valid until reset_activations(); weights (WeightView, the f32 vectors of LayerWeights,
// an expert's bytes) are named by their host addresses and each backend finds its own copy. Outputs
// that the host schedules on (router ids and weights) are host memory, as the signatures say.
//
// Determinism: every op computes each token's row with the same arithmetic whatever the batch size,
// so prefill and token-by-token decoding agree bit for bit on every backend (docs/design.md §8).
#pragma once

#include <cstdint>

#include "backend/op_types.h"
#include "model/kv_cache.h"
#include "sharpi/types.h"

namespace sharpi {

class Backend {
  public:
    virtual ~Backend() = default;
    // "cpu" or "cuda": the prefix of its errors.
    virtual const char* name() const = 0;
    // True when Act data is host memory the caller may read and write directly.
    virtual bool host_memory() const = 0;

    // ---- activations ------------------------------------------------------------------------------
    // [n_tokens, width] f32 rows, valid until reset_activations().
    virtual Act alloc(int64_t n_tokens, int64_t width) = 0;
    virtual void reset_activations() = 0;
    // The residual stream between layers: [n_tokens, width] f32 rows that outlive reset_activations(),
    // the backend's one such buffer, grown as needed (contents not kept), valid until the next call.
    // A device backend's residual must live in its memory, so the driver of the layers asks for it here.
    virtual Act residual(int64_t n_tokens, int64_t width) = 0;
    // host[0 .. n_tokens * width) = x (for dumps and logits).
    virtual void read(const Act& x, float* host) = 0;
    // dst = src (same shape).
    virtual void copy(const Act& src, const Act& dst) = 0;
    // dst rows [0, n_rows) = src rows, `width` elements each, with their own row strides
    // (regrouping heads, splitting a projection's parts).
    virtual void copy_rows(const float* src, int64_t ld_src, float* dst, int64_t ld_dst, int64_t n_rows,
                           int64_t width) = 0;

    // ---- dense ops --------------------------------------------------------------------------------
    // x.row(t) = the dequantized row tokens[t] of `table` (token_embd).
    virtual void get_rows(const WeightView& table, const token_t* tokens, const Act& x) = 0;
    // y = x / rms(x) * weight per row of `width` (row strides ldx, ldy; y may alias x).
    virtual void rms_norm(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t n_rows, int64_t width,
                          const float* weight, float eps) = 0;
    // y[t] = W x[t] for n_tokens rows (exact: f32 on dequantized weights; else fast mode's quantized
    // activations, cpu/ops/matmul.h).
    virtual void matmul(const WeightView& w, const float* x, int64_t ldx, int64_t n_tokens, float* y,
                        int64_t ldy, bool exact) = 0;
    // y.row(t) += bias (f32, y.width elements).
    virtual void add_bias(const Act& y, const float* bias) = 0;
    // y = a + b (same shapes; y may alias either).
    virtual void add(const Act& a, const Act& b, const Act& y) = 0;
    // out = silu(gate) * up over n elements.
    virtual void swiglu(const float* gate, const float* up, float* out, int64_t n) = 0;
    // out = max(x, 0)^2 over n elements (nemotron_h_moe's shared expert; out may alias x).
    virtual void relu_sqr(const float* x, float* out, int64_t n) = 0;
    // x *= sigmoid(gate) over n elements (gated attention's output gate).
    virtual void mul_sigmoid(float* x, const float* gate, int64_t n) = 0;
    // x *= silu(z) over n elements (the Gated DeltaNet's gated norm).
    virtual void mul_silu(float* x, const float* z, int64_t n) = 0;
    // x.row(t) *= sigmoid(s.row(t)[0]) (qwen2moe's shared-expert gate; s is [n_tokens, 1]).
    virtual void scale_rows_sigmoid(const Act& x, const Act& s) = 0;
    // x.row(t) *= scales[t] (scales: host, x.n_tokens floats): llama4's router weight on an expert's
    // input and its attention temperature on the NoPE layers' queries.
    virtual void scale_rows(const Act& x, const float* scales) = 0;
    // y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias per row of `width` (row strides ldx,
    // ldy; y may alias x): the DSA indexer's key norm.
    virtual void layer_norm(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t n_rows, int64_t width,
                            const float* weight, const float* bias, float eps) = 0;
    // RoPE in place on [n_tokens, n_heads * head_dim] (row stride ld), token t at position pos0 + t.
    virtual void rope(float* x, int64_t ld, int64_t n_tokens, int64_t n_heads, int64_t head_dim, int64_t pos0,
                      const RopeParams& p) = 0;

    // ---- attention --------------------------------------------------------------------------------
    // Stores the K rows (and V rows, v non-null) of positions pos0 .. pos0 + k.n_tokens - 1 of layer il,
    // rounded to the cache's types.
    virtual void kv_store(KvCache& kv, int il, int64_t pos0, const Act& k, const Act* v) = 0;
    // Causal attention of q [n_tokens, n_head * head_dim] over the cache rows 0 .. pos0 + t of layer il.
    virtual void attention(const float* q, int64_t ldq, const KvCache& kv, int il, int64_t n_tokens,
                           int64_t pos0, const AttentionShape& shape, float* out, int64_t ldo) = 0;
    // deepseek2's absorbed multi-head latent attention over the latent rows (K cache) of layer il;
    // with a selection (deepseek32) token t attends only to its selected positions.
    virtual void mla_attention(const float* q_abs, int64_t ldq, const KvCache& kv, int il, int64_t n_tokens,
                               int64_t pos0, const MlaShape& shape, const MlaSelection* selection, float* out,
                               int64_t ldo) = 0;
    // The DSA lightning indexer: token t at position pos0 + t scores every cache position j <= pos0 + t
    // of layer il with sum_h w[t,h] * weight_scale * relu(q[t,h] . key_j) and selects the top_k
    // (all of them when there are no more): positions [n_tokens, top_k] ascending and count
    // [n_tokens], host memory.
    virtual void lightning_indexer(const float* q, int64_t ldq, const float* w, int64_t ldw,
                                   const KvCache& kv, int il, int64_t n_tokens, int64_t pos0,
                                   const IndexerShape& shape, int32_t* positions, int32_t* count) = 0;

    // ---- Gated DeltaNet (qwen3next, qwen35moe) ----------------------------------------------------
    // beta = sigmoid(b); g = ssm_a * softplus(a + dt_bias), per token and value head.
    virtual void gdn_gates(const Act& b, const Act& a, const float* ssm_a, const float* dt_bias,
                           const Act& beta, const Act& g) = 0;
    // Causal depthwise conv1d (+ bias [channels] unless nullptr) + SiLU with its rolling state
    // (state: recurrent_state.h's conv).
    virtual void conv1d_silu(float* state, const float* x, int64_t ldx, int64_t n_tokens, int64_t channels,
                             int64_t kernel_size, const float* kernel, const float* bias, float* y,
                             int64_t ldy) = 0;
    // L2-normalises each of the first n_heads heads of head_dim in every row (eps 1e-6 under the
    // root); the first n_scaled heads are also multiplied by `scale`.
    virtual void l2_norm_heads(const Act& x, int64_t n_heads, int64_t head_dim, int64_t n_scaled,
                               float scale) = 0;
    // The gated delta rule over n_tokens (recurrent for one token, chunked of chunk_size for more),
    // reading and updating `state` in place.
    virtual void gated_delta_rule(const GdnInputs& in, int64_t n_tokens, const GdnShape& shape,
                                  int64_t chunk_size, float* state, float* out, int64_t ldo) = 0;

    // ---- Mamba-2 (nemotron_h_moe) -------------------------------------------------------------------
    // The selective scan over n_tokens, token by token, reading and updating `state` ([n_head,
    // head_dim, d_state] f32) in place; out: [T, n_head * head_dim] (ldo), D skip included.
    virtual void ssm_scan(const SsmInputs& in, int64_t n_tokens, const SsmShape& shape, float* state,
                          float* out, int64_t ldo) = 0;

    // ---- DeepSeek-V4 (deepseek4) ---------------------------------------------------------------------
    // y[t] = x[t] / sqrt(mean(x[t]^2) + eps) over rows of `width` (stride ld for both; y may be x).
    virtual void rms_norm_unweighted(const float* x, float* y, int64_t ld, int64_t n_rows, int64_t width,
                                     float eps) = 0;
    // out = silu(min(gate, limit)) * clamp(up, -limit, limit) over n elements (V4's clamped SwiGLU).
    virtual void swiglu_clamped(const float* gate, const float* up, float* out, int64_t n, float limit) = 0;
    // The hyper-connections' weights and stream mixing (cpu/ops/hyper_connection.h has the arithmetic):
    // from a block's mixes [n_tokens, (2 + n_hc) * n_hc] its pre, post [n_tokens, n_hc] and comb
    // [n_tokens, n_hc * n_hc]; from the head's mixes [n_tokens, n_hc] its pre. base, scale: weights.
    virtual void hc_block_weights(const float* mixes, int64_t n_tokens, int64_t n_hc, const float* base,
                                  const float* scale, float eps, int64_t sinkhorn_iters, float* pre,
                                  float* post, float* comb) = 0;
    virtual void hc_head_weights(const float* mixes, int64_t n_tokens, int64_t n_hc, const float* base,
                                 const float* scale, float eps, float* pre) = 0;
    // y[t] = sum_j pre[t, j] x[t, stream j] (x rows [n_hc * d], y rows [d]).
    virtual void hc_collapse(const float* x, int64_t n_tokens, int64_t n_hc, int64_t d, const float* pre,
                             float* y) = 0;
    // y[t, k] = post[t, k] out[t] + sum_j comb[t, j, k] x[t, j] (x, y rows [n_hc * d]; out rows [d]).
    virtual void hc_expand(const float* x, const float* out, int64_t n_tokens, int64_t n_hc, int64_t d,
                           const float* post, const float* comb, float* y) = 0;
    // Stores positions pos0 .. pos0 + n_tokens - 1 of layer il (their KV rows and the compressed
    // entries their windows close: cpu/ops/compressed_attention.h) and writes each token's
    // attention output [n_head * head_dim] to out (row stride ldo). The cache must be f32.
    virtual void compressed_attention(const CompressedAttentionInputs& in, KvCache& kv, int il,
                                      int64_t n_tokens, int64_t pos0, const CompressedAttentionShape& shape,
                                      float* out, int64_t ldo) = 0;

    // ---- MoE --------------------------------------------------------------------------------------
    // Router: gating scores `probs` [n_tokens, n_expert] (backend) and each token's top-k expert ids
    // and weights in rank order ([n_tokens, k], host memory: the expert cache schedules on them).
    virtual void route_topk(const Act& logits, int64_t k, const RouterParams& params, const Act& probs,
                            int32_t* ids, float* weights) = 0;
    // The weights of already chosen experts from one token's gating scores (host memory; route-trace
    // replay), as route_topk computes them.
    virtual void topk_weights(const float* probs, const int32_t* ids, int64_t k, const RouterParams& params,
                              float* weights) = 0;
    // One token's k experts, fused: out = sum_j weights[j] * expert_j(x) (weights: host).
    virtual void expert_ffn_one_token(const ExpertFfnWeights* experts, const float* weights, int k,
                                      const float* x, float* out, bool exact) = 0;
    // One token's expert outputs one slot at a time (the streamed decode path, which computes the
    // slots whose bytes are ready while others are read): y.row(slots[i]) = expert i's output for x,
    // unweighted. Bit for bit the rows expert_ffn_one_token sums.
    virtual void expert_ffn_slots(const ExpertFfnWeights* experts, const int64_t* slots, int64_t n_slots,
                                  const float* x, const Act& y, bool exact) = 0;
    // Prefill: several experts, each over its members (moe/moe_ffn.cpp groups the slots by expert):
    // y + m * ldy = expert e's output for token row x + tokens[m] * ldx, m in [member_begin[e],
    // member_end[e]).
    virtual void expert_ffn_batch(const ExpertFfnWeights* experts, const int64_t* member_begin,
                                  const int64_t* member_end, int n_experts, const int64_t* tokens,
                                  const float* x, int64_t ldx, float* y, int64_t ldy, bool exact) = 0;
    // out.row(t) = sum_j weights[t * k + j] * y.row(member_of[t * k + j]), j = 0..k-1 in order
    // (weights, member_of: host). The one place expert outputs are combined, so every path rounds alike.
    virtual void moe_combine(const Act& y, const int64_t* member_of, const float* weights, int64_t k,
                             const Act& out) = 0;
};

}  // namespace sharpi
