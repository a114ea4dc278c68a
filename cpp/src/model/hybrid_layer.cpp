#include "model/hybrid_layer.h"

#include <algorithm>
#include <cmath>

#include "model/forward.h"
#include "model/model.h"
#include "model/recurrent_state.h"
#include "sharpi/errors.h"

namespace sharpi {

void load_hybrid_layer(ModelLoader& ld, int il, bool v_heads_tiled) {
    const HParams& h = ld.hp();
    LayerWeights& L = ld.layer(il);
    auto blk = [&ld, il](const char* name) { return ld.blk(il, name); };
    L.attn_norm = ld.vector(blk("attn_norm.weight"), h.n_embd);
    if (h.is_recurrent(il)) {
        if (h.ssm_d_conv < 1) {
            throw MissingTensorError("[model] " + ld.model().file->path() + ": layer " + std::to_string(il) +
                                     " is recurrent but the file has no ssm.* hyper-parameters");
        }
        const int64_t channels = h.ssm_conv_channels(), nv = h.ssm_dt_rank;
        L.ssm_qkv.w = ld.optional_matrix(blk("attn_qkv.weight"), h.n_embd, channels);
        if (L.ssm_qkv.present()) {
            L.ssm_gate.w = ld.matrix(blk("attn_gate.weight"), h.n_embd, h.ssm_d_inner);
        } else {
            L.ssm_in.w = ld.optional_matrix(blk("ssm_in.weight"), h.n_embd, channels + h.ssm_d_inner);
            if (!L.ssm_in.present()) {
                throw MissingTensorError("[model] " + ld.model().file->path() + ": missing tensor " +
                                         blk("attn_qkv.weight") + " (or the older " + blk("ssm_in.weight") +
                                         "), required by arch " + h.arch);
            }
        }
        L.ssm_ba.w = ld.optional_matrix(blk("ssm_ba.weight"), h.n_embd, 2 * nv);
        if (!L.ssm_ba.present()) {
            L.ssm_beta.w = ld.matrix(blk("ssm_beta.weight"), h.n_embd, nv);
            L.ssm_alpha.w = ld.matrix(blk("ssm_alpha.weight"), h.n_embd, nv);
        }
        // [channels, d_conv] f32, channel-major: the conv kernel as cpu/ops/gated_delta_net.h reads it.
        L.ssm_conv1d = ld.stacked_vector(blk("ssm_conv1d.weight"), h.ssm_d_conv, channels);
        L.ssm_a = ld.vector(blk("ssm_a"), nv);
        L.ssm_dt_bias = ld.vector(blk("ssm_dt.bias"), nv);
        L.ssm_norm = ld.vector(blk("ssm_norm.weight"), h.ssm_head_v_dim());
        L.ssm_out.w = ld.matrix(blk("ssm_out.weight"), h.ssm_d_inner, h.n_embd);
        L.ssm_v_heads_tiled = v_heads_tiled;
    } else {
        L.wq.w = ld.matrix(blk("attn_q.weight"), h.n_embd, 2 * h.n_embd_q());
        L.wk.w = ld.matrix(blk("attn_k.weight"), h.n_embd, h.n_embd_kv());
        L.wv.w = ld.matrix(blk("attn_v.weight"), h.n_embd, h.n_embd_kv());
        L.wo.w = ld.matrix(blk("attn_output.weight"), h.n_embd_q(), h.n_embd);
        ld.qk_norm(il, h.head_dim, h.head_dim);
        L.attn_output_gate = true;
    }
    ld.moe(il, "post_attention_norm.weight");
    ld.shared_expert(il);
}

Act Forward::split_query_gate(const Act& q_full, Act* gate, int il) {
    const int64_t hd = hp().head_dim, n_head = hp().n_head;
    Act q = alloc(q_full.n_tokens, n_head * hd);
    *gate = alloc(q_full.n_tokens, n_head * hd);
    // Row (t, head) of q_full is [query | gate] of 2 * hd: two strided copies over T * n_head rows.
    const int64_t rows = q_full.n_tokens * n_head;
    backend_.copy_rows(q_full.data, 2 * hd, q.data, hd, rows, hd);
    backend_.copy_rows(q_full.data + hd, 2 * hd, gate->data, hd, rows, hd);
    name(*gate, "gate", il);
    return q;
}

void Forward::output_gate(const Act& kqv, const Act& gate, int il) {
    backend_.mul_sigmoid(kqv.data, gate.data, kqv.n_tokens * kqv.width);
    name(kqv, "attn_gated", il);
}

Act Forward::gated_delta_net(const Act& cur, int il) {
    const HParams& h = hp();
    const LayerWeights& L = layer(il);
    for (const SeqSpan& s : spans_) {
        if (!s.recurrent)
            throw InvalidArgument("[forward] layer " + std::to_string(il) + " needs a recurrent state");
    }
    const int64_t T = cur.n_tokens;
    const int64_t nk = h.ssm_n_group, nv = h.ssm_dt_rank, dk = h.ssm_d_state, dv = h.ssm_head_v_dim();
    const int64_t key_dim = nk * dk, channels = h.ssm_conv_channels();

    Act qkv, z;
    if (L.ssm_in.present()) {
        // Older files: one projection holding, per key head g, [q_g, k_g, v of its r value heads,
        // z of them]; regroup into the conv channels [q | k | v] and z.
        Act mixed = linear(cur, L.ssm_in, "linear_attn_mixed_qkvz", il);
        qkv = alloc(T, channels);
        z = alloc(T, h.ssm_d_inner);
        const int64_t vg = (nv / nk) * dv, per = 2 * dk + 2 * vg;
        for (int64_t kg = 0; kg < nk; ++kg) {
            const float* src = mixed.data + kg * per;
            backend_.copy_rows(src, mixed.width, qkv.data + kg * dk, qkv.width, T, dk);
            backend_.copy_rows(src + dk, mixed.width, qkv.data + key_dim + kg * dk, qkv.width, T, dk);
            backend_.copy_rows(src + 2 * dk, mixed.width, qkv.data + 2 * key_dim + kg * vg, qkv.width, T, vg);
            backend_.copy_rows(src + 2 * dk + vg, mixed.width, z.data + kg * vg, z.width, T, vg);
        }
    } else {
        qkv = linear(cur, L.ssm_qkv, "linear_attn_qkv_mixed", il);
        z = linear(cur, L.ssm_gate, "z", il);
    }
    // beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), per token and value head.
    Act beta = alloc(T, nv), g = alloc(T, nv);
    Act b, a;
    if (L.ssm_ba.present()) {
        Act ba = linear(cur, L.ssm_ba, "linear_attn_mixed_ba", il);
        b = alloc(T, nv);
        a = alloc(T, nv);
        const int64_t r = nv / nk;  // per key head: [b of its r value heads | a of them]
        for (int64_t kg = 0; kg < nk; ++kg) {
            backend_.copy_rows(ba.data + kg * 2 * r, ba.width, b.data + kg * r, b.width, T, r);
            backend_.copy_rows(ba.data + kg * 2 * r + r, ba.width, a.data + kg * r, a.width, T, r);
        }
    } else {
        b = linear(cur, L.ssm_beta, "beta", il);
        a = linear(cur, L.ssm_alpha, "alpha", il);
    }
    backend_.gdn_gates(b, a, L.ssm_a.data(), L.ssm_dt_bias.data(), beta, g);
    name(g, "gate", il);

    // The conv and the delta rule carry state along a sequence: span by span, each with its own.
    Act conv = alloc(T, channels);
    // A rewindable span runs the conv and the delta rule token by token (exactly what one-token
    // decodes compute) so that the state after each token can be kept.
    for (const SeqSpan& s : spans_) {
        const int64_t steps = s.rewindable ? s.n_tokens : 1, per = s.rewindable ? 1 : s.n_tokens;
        for (int64_t t = 0; t < steps; ++t) {
            const int64_t r = s.row0 + t;
            backend_.conv1d_silu(s.recurrent->conv(il), qkv.row(r), qkv.width, per, channels, h.ssm_d_conv,
                                 L.ssm_conv1d.data(), /*bias=*/nullptr, conv.row(r), conv.width);
            if (s.rewindable) s.recurrent->save_conv_point(il, s.pos0 + t + 1);
        }
    }
    name(conv, "conv_output_silu", il);
    // L2-normalise every q and k head (eps as transformers / FLA: x / sqrt(sum x^2 + 1e-6)); q also
    // takes the 1/sqrt(head_k_dim) attention scale.
    const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
    backend_.l2_norm_heads(conv, 2 * nk, dk, nk, q_scale);

    GdnShape shape{nk, nv, dk, dv, L.ssm_v_heads_tiled};
    Act o = alloc(T, nv * dv);
    for (const SeqSpan& s : spans_) {
        const int64_t steps = s.rewindable ? s.n_tokens : 1, per = s.rewindable ? 1 : s.n_tokens;
        for (int64_t t = 0; t < steps; ++t) {
            const int64_t r = s.row0 + t;
            const float* c = conv.row(r);
            GdnInputs in{c,        channels, c + key_dim, channels, c + 2 * key_dim,
                         channels, g.row(r), beta.row(r)};
            backend_.gated_delta_rule(in, per, shape, kGdnChunkSize, s.recurrent->ssm(il), o.row(r), o.width);
            if (s.rewindable) s.recurrent->save_ssm_point(il, s.pos0 + t + 1);
        }
    }
    name(o, "core_attn_out", il);
    // Gated RMSNorm per value head: rms_norm(o_h) * ssm_norm * silu(z_h).
    backend_.rms_norm(o.data, dv, o.data, dv, T * nv, dv, L.ssm_norm.data(), h.rms_eps);
    backend_.mul_silu(o.data, z.data, T * nv * dv);
    name(o, "final_output", il);
    return linear(o, L.ssm_out, "linear_attn_out", il);
}

}  // namespace sharpi
