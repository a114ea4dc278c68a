#include "cpu/cpu_backend.h"

#include <cmath>
#include <cstring>

#include "cpu/ops/activation.h"
#include "cpu/ops/attention.h"
#include "cpu/ops/compressed_attention.h"
#include "cpu/ops/expert_ffn.h"
#include "cpu/ops/gated_delta_net.h"
#include "cpu/ops/hyper_connection.h"
#include "cpu/ops/layer_norm.h"
#include "cpu/ops/lightning_indexer.h"
#include "cpu/ops/matmul.h"
#include "cpu/ops/mla_attention.h"
#include "cpu/ops/rms_norm.h"
#include "cpu/ops/rope.h"
#include "cpu/ops/router.h"
#include "cpu/ops/ssm_scan.h"
#include "cpu/quant/kernels.h"
#include "sharpi/errors.h"

namespace sharpi {

namespace {

float softplus(float x) {
    return x > 20.0f ? x : std::log1p(std::exp(x));  // torch's and ggml's threshold
}

}  // namespace

// ---- activations --------------------------------------------------------------------------------

Act CpuBackend::alloc(int64_t n_tokens, int64_t width) {
    return Act{scratch_.alloc(n_tokens * width), n_tokens, width};
}

void CpuBackend::reset_activations() {
    scratch_.reset();
}

Act CpuBackend::residual(int64_t n_tokens, int64_t width) {
    residual_.resize(static_cast<size_t>(n_tokens * width));
    return Act{residual_.data(), n_tokens, width};
}

void CpuBackend::read(const Act& x, float* host) {
    std::memcpy(host, x.data, sizeof(float) * static_cast<size_t>(x.n_tokens * x.width));
}

void CpuBackend::copy(const Act& src, const Act& dst) {
    std::memcpy(dst.data, src.data, sizeof(float) * static_cast<size_t>(src.n_tokens * src.width));
}

void CpuBackend::copy_rows(const float* src, int64_t ld_src, float* dst, int64_t ld_dst, int64_t n_rows,
                           int64_t width) {
    for (int64_t r = 0; r < n_rows; ++r) {
        std::memcpy(dst + r * ld_dst, src + r * ld_src, sizeof(float) * static_cast<size_t>(width));
    }
}

// ---- dense ops ----------------------------------------------------------------------------------

void CpuBackend::get_rows(const WeightView& table, const token_t* tokens, const Act& x) {
    const cpu::DequantRowFn dequant = cpu::row_kernels(table.type).dequant_row;
    for (int64_t t = 0; t < x.n_tokens; ++t) {
        dequant(table.data + static_cast<size_t>(tokens[t]) * table.row_bytes, x.row(t), x.width);
    }
}

void CpuBackend::layer_norm(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t n_rows, int64_t width,
                            const float* weight, const float* bias, float eps) {
    cpu::layer_norm(x, ldx, y, ldy, n_rows, width, weight, bias, eps);
}

void CpuBackend::rms_norm(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t n_rows, int64_t width,
                          const float* weight, float eps) {
    cpu::rms_norm(x, ldx, y, ldy, n_rows, width, weight, eps);
}

void CpuBackend::matmul(const WeightView& w, const float* x, int64_t ldx, int64_t n_tokens, float* y,
                        int64_t ldy, bool exact) {
    cpu::matmul(pool_, w, x, ldx, n_tokens, y, ldy, exact);
}

void CpuBackend::add_bias(const Act& y, const float* bias) {
    for (int64_t t = 0; t < y.n_tokens; ++t) {
        float* r = y.row(t);
        for (int64_t i = 0; i < y.width; ++i) r[i] += bias[i];
    }
}

void CpuBackend::add(const Act& a, const Act& b, const Act& y) {
    const int64_t n = a.n_tokens * a.width;
    for (int64_t i = 0; i < n; ++i) y.data[i] = a.data[i] + b.data[i];
}

void CpuBackend::swiglu(const float* gate, const float* up, float* out, int64_t n) {
    cpu::swiglu(gate, up, out, n);
}

void CpuBackend::mul_sigmoid(float* x, const float* gate, int64_t n) {
    for (int64_t i = 0; i < n; ++i) x[i] *= cpu::sigmoid(gate[i]);
}

void CpuBackend::relu_sqr(const float* x, float* out, int64_t n) {
    cpu::relu_sqr(x, out, n);
}

void CpuBackend::mul_silu(float* x, const float* z, int64_t n) {
    for (int64_t i = 0; i < n; ++i) x[i] *= z[i] * cpu::sigmoid(z[i]);
}

void CpuBackend::scale_rows(const Act& x, const float* scales) {
    for (int64_t t = 0; t < x.n_tokens; ++t) {
        const float w = scales[t];
        float* row = x.row(t);
        for (int64_t i = 0; i < x.width; ++i) row[i] *= w;
    }
}

void CpuBackend::scale_rows_sigmoid(const Act& x, const Act& s) {
    for (int64_t t = 0; t < x.n_tokens; ++t) {
        const float w = cpu::sigmoid(s.row(t)[0]);
        float* row = x.row(t);
        for (int64_t i = 0; i < x.width; ++i) row[i] *= w;
    }
}

void CpuBackend::rope(float* x, int64_t ld, int64_t n_tokens, int64_t n_heads, int64_t head_dim, int64_t pos0,
                      const RopeParams& p) {
    cpu::rope(x, ld, n_tokens, n_heads, head_dim, pos0, p);
}

// ---- attention ----------------------------------------------------------------------------------

void CpuBackend::kv_store(KvCache& kv, int il, int64_t pos0, const Act& k, const Act* v) {
    for (int64_t t = 0; t < k.n_tokens; ++t) {
        if (v) {
            kv.store(il, pos0 + t, k.row(t), v->row(t));
        } else {
            kv.store_k(il, pos0 + t, k.row(t));
        }
    }
}

void CpuBackend::attention(const float* q, int64_t ldq, const KvCache& kv, int il, int64_t n_tokens,
                           int64_t pos0, const AttentionShape& shape, float* out, int64_t ldo) {
    const KvRows k_rows{kv.k(il), kv.row_bytes_k(), kv.type_k()};
    const KvRows v_rows{kv.v(il), kv.row_bytes_v(), kv.type_v()};
    cpu::attention(pool_, q, ldq, k_rows, v_rows, n_tokens, pos0, shape, out, ldo);
}

void CpuBackend::mla_attention(const float* q_abs, int64_t ldq, const KvCache& kv, int il, int64_t n_tokens,
                               int64_t pos0, const MlaShape& shape, const MlaSelection* selection, float* out,
                               int64_t ldo) {
    const KvRows latent{kv.k(il), kv.row_bytes_k(), kv.type_k()};
    cpu::mla_attention(pool_, q_abs, ldq, latent, n_tokens, pos0, shape, out, ldo, cpu::active_isa(),
                       selection);
}

void CpuBackend::lightning_indexer(const float* q, int64_t ldq, const float* w, int64_t ldw,
                                   const KvCache& kv, int il, int64_t n_tokens, int64_t pos0,
                                   const IndexerShape& shape, int32_t* positions, int32_t* count) {
    const KvRows rows{kv.k(il), kv.row_bytes_k(), kv.type_k()};
    cpu::lightning_indexer(pool_, q, ldq, w, ldw, rows, n_tokens, pos0, shape, positions, count);
}

// ---- Gated DeltaNet -----------------------------------------------------------------------------

void CpuBackend::gdn_gates(const Act& b, const Act& a, const float* ssm_a, const float* dt_bias,
                           const Act& beta, const Act& g) {
    for (int64_t t = 0; t < b.n_tokens; ++t) {
        for (int64_t hh = 0; hh < b.width; ++hh) {
            beta.row(t)[hh] = cpu::sigmoid(b.row(t)[hh]);
            g.row(t)[hh] = ssm_a[hh] * softplus(a.row(t)[hh] + dt_bias[hh]);
        }
    }
}

void CpuBackend::conv1d_silu(float* state, const float* x, int64_t ldx, int64_t n_tokens, int64_t channels,
                             int64_t kernel_size, const float* kernel, const float* bias, float* y,
                             int64_t ldy) {
    cpu::conv1d_silu(state, x, ldx, n_tokens, channels, kernel_size, kernel, bias, y, ldy);
}

void CpuBackend::l2_norm_heads(const Act& x, int64_t n_heads, int64_t head_dim, int64_t n_scaled,
                               float scale) {
    for (int64_t t = 0; t < x.n_tokens; ++t) {
        for (int64_t head = 0; head < n_heads; ++head) {
            float* h = x.row(t) + head * head_dim;
            double ss = 0.0;
            for (int64_t i = 0; i < head_dim; ++i) ss += static_cast<double>(h[i]) * h[i];
            float inv = static_cast<float>(1.0 / std::sqrt(ss + 1e-6));
            if (head < n_scaled) inv *= scale;
            for (int64_t i = 0; i < head_dim; ++i) h[i] *= inv;
        }
    }
}

void CpuBackend::gated_delta_rule(const GdnInputs& in, int64_t n_tokens, const GdnShape& shape,
                                  int64_t chunk_size, float* state, float* out, int64_t ldo) {
    if (n_tokens == 1) {
        cpu::gated_delta_rule_recurrent(pool_, in, n_tokens, shape, state, out, ldo);
    } else {
        cpu::gated_delta_rule_chunked(pool_, in, n_tokens, shape, chunk_size, state, out, ldo);
    }
}

void CpuBackend::ssm_scan(const SsmInputs& in, int64_t n_tokens, const SsmShape& shape, float* state,
                          float* out, int64_t ldo) {
    cpu::ssm_scan(pool_, in, n_tokens, shape, state, out, ldo);
}

// ---- DeepSeek-V4 ----------------------------------------------------------------------------------

void CpuBackend::rms_norm_unweighted(const float* x, float* y, int64_t ld, int64_t n_rows, int64_t width,
                                     float eps) {
    cpu::rms_norm_unweighted(x, y, ld, n_rows, width, eps);
}
void CpuBackend::swiglu_clamped(const float* gate, const float* up, float* out, int64_t n, float limit) {
    cpu::swiglu_clamped(gate, up, out, n, limit);
}
void CpuBackend::hc_block_weights(const float* mixes, int64_t n_tokens, int64_t n_hc, const float* base,
                                  const float* scale, float eps, int64_t sinkhorn_iters, float* pre,
                                  float* post, float* comb) {
    cpu::hc_block_weights(mixes, n_tokens, n_hc, base, scale, eps, sinkhorn_iters, pre, post, comb);
}
void CpuBackend::hc_head_weights(const float* mixes, int64_t n_tokens, int64_t n_hc, const float* base,
                                 const float* scale, float eps, float* pre) {
    cpu::hc_head_weights(mixes, n_tokens, n_hc, base, scale, eps, pre);
}
void CpuBackend::hc_collapse(const float* x, int64_t n_tokens, int64_t n_hc, int64_t d, const float* pre,
                             float* y) {
    cpu::hc_collapse(x, n_tokens, n_hc, d, pre, y);
}
void CpuBackend::hc_expand(const float* x, const float* out, int64_t n_tokens, int64_t n_hc, int64_t d,
                           const float* post, const float* comb, float* y) {
    cpu::hc_expand(x, out, n_tokens, n_hc, d, post, comb, y);
}
void CpuBackend::compressed_attention(const CompressedAttentionInputs& in, KvCache& kv, int il,
                                      int64_t n_tokens, int64_t pos0, const CompressedAttentionShape& shape,
                                      float* out, int64_t ldo) {
    if (kv.type_k() != GgmlType::F32)
        throw UnsupportedError("[cpu] compressed_attention keeps its rows in an f32 cache, not " +
                               std::string(ggml_type_traits(kv.type_k()).name));
    const cpu::F32Rows rows{reinterpret_cast<float*>(kv.k_mutable(il)),
                            static_cast<int64_t>(kv.row_bytes_k() / sizeof(float))};
    cpu::compressed_attention(pool_, in, rows, n_tokens, pos0, shape, out, ldo);
}

// ---- MoE ----------------------------------------------------------------------------------------

void CpuBackend::route_topk(const Act& logits, int64_t k, const RouterParams& params, const Act& probs,
                            int32_t* ids, float* weights) {
    cpu::route_topk(logits.data, logits.n_tokens, logits.width, k, params, probs.data, ids, weights);
}

void CpuBackend::topk_weights(const float* probs, const int32_t* ids, int64_t k, const RouterParams& params,
                              float* weights) {
    cpu::topk_weights(probs, ids, k, params, weights);
}

void CpuBackend::expert_ffn_one_token(const ExpertFfnWeights* experts, const float* weights, int k,
                                      const float* x, float* out, bool exact) {
    cpu::expert_ffn_one_token(pool_, experts, weights, k, x, out, exact);
}

void CpuBackend::expert_ffn_slots(const ExpertFfnWeights* experts, const int64_t* slots, int64_t n_slots,
                                  const float* x, const Act& y, bool exact) {
    cpu::expert_ffn_slots(pool_, experts, slots, n_slots, x, y.data, y.width, exact);
}

void CpuBackend::expert_ffn_batch(const ExpertFfnWeights* experts, const int64_t* member_begin,
                                  const int64_t* member_end, int n_experts, const int64_t* tokens,
                                  const float* x, int64_t ldx, float* y, int64_t ldy, bool exact) {
    cpu::expert_ffn_batch(pool_, experts, member_begin, member_end, n_experts, tokens, x, ldx, y, ldy, exact);
}

void CpuBackend::moe_combine(const Act& y, const int64_t* member_of, const float* weights, int64_t k,
                             const Act& out) {
    const int64_t n = out.width;
    for (int64_t t = 0; t < out.n_tokens; ++t) {
        const float* w = weights + t * k;
        const int64_t* m = member_of + t * k;
        float* o = out.row(t);
        const float* y0 = y.row(m[0]);
        for (int64_t i = 0; i < n; ++i) o[i] = w[0] * y0[i];
        for (int64_t j = 1; j < k; ++j) {
            const float* yj = y.row(m[j]);
            for (int64_t i = 0; i < n; ++i) o[i] += w[j] * yj[i];
        }
    }
}

}  // namespace sharpi
