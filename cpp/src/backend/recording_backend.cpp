#include "backend/recording_backend.h"

#include <utility>

namespace sharpi {

void RecordingBackend::record(const char* op, GgmlType type, std::string variant) {
    calls_.push_back(OpCall{op, type, std::move(variant)});
}

void RecordingBackend::record_experts(const char* op, const ExpertFfnWeights* experts, int64_t n,
                                      bool exact) {
    for (OpCall& c : expert_calls(op, experts, n, exact)) calls_.push_back(std::move(c));
}

void RecordingBackend::read_weight(const char* op, const void* data) {
    if (data != nullptr) weight_reads_.push_back(WeightRead{op, data});
}

void RecordingBackend::read_experts(const char* op, const ExpertFfnWeights* experts, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        const ExpertFfnWeights& e = experts[i];
        for (const void* p : {static_cast<const void*>(e.gate.data), static_cast<const void*>(e.up.data),
                              static_cast<const void*>(e.down.data), static_cast<const void*>(e.gate_b),
                              static_cast<const void*>(e.up_b), static_cast<const void*>(e.down_b)}) {
            read_weight(op, p);
        }
    }
}

Act RecordingBackend::alloc(int64_t n_tokens, int64_t width) {
    return inner_.alloc(n_tokens, width);
}
void RecordingBackend::reset_activations() {
    inner_.reset_activations();
}
Act RecordingBackend::residual(int64_t n_tokens, int64_t width) {
    return inner_.residual(n_tokens, width);
}
void RecordingBackend::read(const Act& x, float* host) {
    inner_.read(x, host);
}
void RecordingBackend::copy(const Act& src, const Act& dst) {
    record("copy");
    inner_.copy(src, dst);
}
void RecordingBackend::copy_rows(const float* src, int64_t ld_src, float* dst, int64_t ld_dst, int64_t n_rows,
                                 int64_t width) {
    record("copy_rows");
    inner_.copy_rows(src, ld_src, dst, ld_dst, n_rows, width);
}

void RecordingBackend::get_rows(const WeightView& table, const token_t* tokens, const Act& x) {
    record("get_rows", table.type);
    read_weight("get_rows", table.data);
    inner_.get_rows(table, tokens, x);
}
void RecordingBackend::rms_norm(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t n_rows,
                                int64_t width, const float* weight, float eps) {
    record("rms_norm");
    read_weight("rms_norm", weight);
    inner_.rms_norm(x, ldx, y, ldy, n_rows, width, weight, eps);
}
void RecordingBackend::layer_norm(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t n_rows,
                                  int64_t width, const float* weight, const float* bias, float eps) {
    record("layer_norm");
    read_weight("layer_norm", weight);
    read_weight("layer_norm", bias);
    inner_.layer_norm(x, ldx, y, ldy, n_rows, width, weight, bias, eps);
}
void RecordingBackend::matmul(const WeightView& w, const float* x, int64_t ldx, int64_t n_tokens, float* y,
                              int64_t ldy, bool exact) {
    calls_.push_back(matmul_call(w, exact));
    read_weight("matmul", w.data);
    inner_.matmul(w, x, ldx, n_tokens, y, ldy, exact);
}
void RecordingBackend::add_bias(const Act& y, const float* bias) {
    record("add_bias");
    read_weight("add_bias", bias);
    inner_.add_bias(y, bias);
}
void RecordingBackend::add(const Act& a, const Act& b, const Act& y) {
    record("add");
    inner_.add(a, b, y);
}
void RecordingBackend::swiglu(const float* gate, const float* up, float* out, int64_t n) {
    record("swiglu");
    inner_.swiglu(gate, up, out, n);
}
void RecordingBackend::mul_sigmoid(float* x, const float* gate, int64_t n) {
    record("mul_sigmoid");
    inner_.mul_sigmoid(x, gate, n);
}
void RecordingBackend::relu_sqr(const float* x, float* out, int64_t n) {
    record("relu_sqr");
    inner_.relu_sqr(x, out, n);
}

void RecordingBackend::mul_silu(float* x, const float* z, int64_t n) {
    record("mul_silu");
    inner_.mul_silu(x, z, n);
}
void RecordingBackend::scale_rows(const Act& x, const float* scales) {
    record("scale_rows");
    inner_.scale_rows(x, scales);
}

void RecordingBackend::scale_rows_sigmoid(const Act& x, const Act& s) {
    record("scale_rows_sigmoid");
    inner_.scale_rows_sigmoid(x, s);
}
void RecordingBackend::rope(float* x, int64_t ld, int64_t n_tokens, int64_t n_heads, int64_t head_dim,
                            int64_t pos0, const RopeParams& p) {
    calls_.push_back(rope_call(p));
    inner_.rope(x, ld, n_tokens, n_heads, head_dim, pos0, p);
}

void RecordingBackend::kv_store(KvCache& kv, int il, int64_t pos0, const Act& k, const Act* v) {
    for (OpCall& c : kv_store_calls(kv.type_k(), kv.type_v(), v != nullptr)) calls_.push_back(std::move(c));
    inner_.kv_store(kv, il, pos0, k, v);
}
void RecordingBackend::attention(const float* q, int64_t ldq, const KvCache& kv, int il, int64_t n_tokens,
                                 int64_t pos0, const AttentionShape& shape, float* out, int64_t ldo) {
    calls_.push_back(attention_call(kv.type_k(), shape));
    read_weight("attention", shape.sinks);
    inner_.attention(q, ldq, kv, il, n_tokens, pos0, shape, out, ldo);
}
void RecordingBackend::mla_attention(const float* q_abs, int64_t ldq, const KvCache& kv, int il,
                                     int64_t n_tokens, int64_t pos0, const MlaShape& shape,
                                     const MlaSelection* selection, float* out, int64_t ldo) {
    record("mla_attention", kv.type_k(), selection ? "sparse" : "");
    inner_.mla_attention(q_abs, ldq, kv, il, n_tokens, pos0, shape, selection, out, ldo);
}
void RecordingBackend::lightning_indexer(const float* q, int64_t ldq, const float* w, int64_t ldw,
                                         const KvCache& kv, int il, int64_t n_tokens, int64_t pos0,
                                         const IndexerShape& shape, int32_t* positions, int32_t* count) {
    record("lightning_indexer", kv.type_k());
    inner_.lightning_indexer(q, ldq, w, ldw, kv, il, n_tokens, pos0, shape, positions, count);
}

void RecordingBackend::gdn_gates(const Act& b, const Act& a, const float* ssm_a, const float* dt_bias,
                                 const Act& beta, const Act& g) {
    record("gdn_gates");
    read_weight("gdn_gates", ssm_a);
    read_weight("gdn_gates", dt_bias);
    inner_.gdn_gates(b, a, ssm_a, dt_bias, beta, g);
}
void RecordingBackend::conv1d_silu(float* state, const float* x, int64_t ldx, int64_t n_tokens,
                                   int64_t channels, int64_t kernel_size, const float* kernel,
                                   const float* bias, float* y, int64_t ldy) {
    record("conv1d_silu");
    read_weight("conv1d_silu", kernel);
    if (bias) read_weight("conv1d_silu", bias);
    inner_.conv1d_silu(state, x, ldx, n_tokens, channels, kernel_size, kernel, bias, y, ldy);
}
void RecordingBackend::l2_norm_heads(const Act& x, int64_t n_heads, int64_t head_dim, int64_t n_scaled,
                                     float scale) {
    record("l2_norm_heads");
    inner_.l2_norm_heads(x, n_heads, head_dim, n_scaled, scale);
}
void RecordingBackend::gated_delta_rule(const GdnInputs& in, int64_t n_tokens, const GdnShape& shape,
                                        int64_t chunk_size, float* state, float* out, int64_t ldo) {
    record("gated_delta_rule");
    inner_.gated_delta_rule(in, n_tokens, shape, chunk_size, state, out, ldo);
}
void RecordingBackend::ssm_scan(const SsmInputs& in, int64_t n_tokens, const SsmShape& shape, float* state,
                                float* out, int64_t ldo) {
    record("ssm_scan");
    for (const float* w : {in.a, in.d, in.dt_bias}) read_weight("ssm_scan", w);
    inner_.ssm_scan(in, n_tokens, shape, state, out, ldo);
}

// ---- DeepSeek-V4 ----------------------------------------------------------------------------------

void RecordingBackend::rms_norm_unweighted(const float* x, float* y, int64_t ld, int64_t n_rows,
                                           int64_t width, float eps) {
    record("rms_norm_unweighted");
    inner_.rms_norm_unweighted(x, y, ld, n_rows, width, eps);
}
void RecordingBackend::swiglu_clamped(const float* gate, const float* up, float* out, int64_t n,
                                      float limit) {
    record("swiglu_clamped");
    inner_.swiglu_clamped(gate, up, out, n, limit);
}
void RecordingBackend::hc_block_weights(const float* mixes, int64_t n_tokens, int64_t n_hc, const float* base,
                                        const float* scale, float eps, int64_t sinkhorn_iters, float* pre,
                                        float* post, float* comb) {
    record("hc_block_weights");
    read_weight("hc_block_weights", base);
    read_weight("hc_block_weights", scale);
    inner_.hc_block_weights(mixes, n_tokens, n_hc, base, scale, eps, sinkhorn_iters, pre, post, comb);
}
void RecordingBackend::hc_head_weights(const float* mixes, int64_t n_tokens, int64_t n_hc, const float* base,
                                       const float* scale, float eps, float* pre) {
    record("hc_head_weights");
    read_weight("hc_head_weights", base);
    read_weight("hc_head_weights", scale);
    inner_.hc_head_weights(mixes, n_tokens, n_hc, base, scale, eps, pre);
}
void RecordingBackend::hc_collapse(const float* x, int64_t n_tokens, int64_t n_hc, int64_t d,
                                   const float* pre, float* y) {
    record("hc_collapse");
    inner_.hc_collapse(x, n_tokens, n_hc, d, pre, y);
}
void RecordingBackend::hc_expand(const float* x, const float* out, int64_t n_tokens, int64_t n_hc, int64_t d,
                                 const float* post, const float* comb, float* y) {
    record("hc_expand");
    inner_.hc_expand(x, out, n_tokens, n_hc, d, post, comb, y);
}
void RecordingBackend::compressed_attention(const CompressedAttentionInputs& in, KvCache& kv, int il,
                                            int64_t n_tokens, int64_t pos0,
                                            const CompressedAttentionShape& shape, float* out, int64_t ldo) {
    record("compressed_attention", kv.type_k(), "ratio=" + std::to_string(shape.ratio));
    for (const float* w : {in.comp_ape, in.comp_norm, in.idx_ape, in.idx_norm, in.sinks})
        read_weight("compressed_attention", w);
    inner_.compressed_attention(in, kv, il, n_tokens, pos0, shape, out, ldo);
}

void RecordingBackend::route_topk(const Act& logits, int64_t k, const RouterParams& params, const Act& probs,
                                  int32_t* ids, float* weights) {
    calls_.push_back(route_topk_call(params, logits.width));
    read_weight("route_topk", params.selection_bias);
    inner_.route_topk(logits, k, params, probs, ids, weights);
}
void RecordingBackend::topk_weights(const float* probs, const int32_t* ids, int64_t k,
                                    const RouterParams& params, float* weights) {
    record("topk_weights");
    inner_.topk_weights(probs, ids, k, params, weights);
}
void RecordingBackend::expert_ffn_one_token(const ExpertFfnWeights* experts, const float* weights, int k,
                                            const float* x, float* out, bool exact) {
    record_experts("expert_ffn_one_token", experts, k, exact);
    read_experts("expert_ffn_one_token", experts, k);
    inner_.expert_ffn_one_token(experts, weights, k, x, out, exact);
}
void RecordingBackend::expert_ffn_slots(const ExpertFfnWeights* experts, const int64_t* slots,
                                        int64_t n_slots, const float* x, const Act& y, bool exact) {
    record_experts("expert_ffn_slots", experts, n_slots, exact);
    read_experts("expert_ffn_slots", experts, n_slots);
    inner_.expert_ffn_slots(experts, slots, n_slots, x, y, exact);
}
void RecordingBackend::expert_ffn_batch(const ExpertFfnWeights* experts, const int64_t* member_begin,
                                        const int64_t* member_end, int n_experts, const int64_t* tokens,
                                        const float* x, int64_t ldx, float* y, int64_t ldy, bool exact) {
    record_experts("expert_ffn_batch", experts, n_experts, exact);
    read_experts("expert_ffn_batch", experts, n_experts);
    inner_.expert_ffn_batch(experts, member_begin, member_end, n_experts, tokens, x, ldx, y, ldy, exact);
}
void RecordingBackend::moe_combine(const Act& y, const int64_t* member_of, const float* weights, int64_t k,
                                   const Act& out) {
    record("moe_combine");
    inner_.moe_combine(y, member_of, weights, k, out);
}

}  // namespace sharpi
