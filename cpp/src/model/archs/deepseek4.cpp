// deepseek4: DeepSeek-V4 (Flash / Pro). docs/design.md §12 lists what it adds to deepseek2; the
// arithmetic follows transformers' modeling_deepseek_v4.py, the tensors llama.cpp's converter.
//
// A layer: two manifold-constrained hyper-connections (cpu/ops/hyper_connection.h) around an
// attention block and a MoE block; the residual row is hc_mult streams of n_embd.
//
// Attention: shared-KV MQA (one kv row of head_dim that is K and V), q through the q LoRA with an
// unweighted per-head RMSNorm, RoPE on each head's trailing n_rot dims, a per-head sink, the
// output's rope dims rotated back by -position, grouped output projection. Every layer attends to
// the last sliding_window positions (the query's included); compressed layers (ratio 4: CSA,
// 128: HCA) also attend to compressed entries, one per closed window of `ratio` positions, which a
// query at position p sees when w < (p + 1) / ratio. HCA takes all of them; CSA the indexer's
// top_k (higher score first, equal scores: lower entry first).
//
// Per-sequence state (the window rows, the compressors' rows and the entries they emit) lives in
// the layer's f32 KV row of each position; cpu/ops/compressed_attention.h lays it out and says why
// prefill, decode, chunks, truncation and batching give the same bits.
//
// The builders compute through the backend's ops only (rms_norm_unweighted, the hc_* ops,
// compressed_attention, swiglu_clamped); the CUDA backend has no kernels for them yet and its
// table names them (cuda/op_support.cpp).
#include <vector>

#include "model/arch.h"
#include "model/forward.h"
#include "model/model.h"
#include "sharpi/errors.h"

namespace sharpi {

static void load_deepseek4_layer(ModelLoader& ld, int il) {
    const HParams& h = ld.hp();
    LayerWeights& L = ld.layer(il);
    const int64_t D = h.head_dim, E = h.n_embd, n_hc = h.hc_mult, n_mix = (2 + n_hc) * n_hc;
    L.attn_norm = ld.vector(ld.blk(il, "attn_norm.weight"), E);
    L.attn_sinks = ld.vector(ld.blk(il, "attn_sinks.weight"), h.n_head);
    L.wq_a.w = ld.matrix(ld.blk(il, "attn_q_a.weight"), E, h.n_lora_q);
    L.attn_q_a_norm = ld.vector(ld.blk(il, "attn_q_a_norm.weight"), h.n_lora_q);
    L.wq_b.w = ld.matrix(ld.blk(il, "attn_q_b.weight"), h.n_lora_q, h.n_head * D);
    L.wkv.w = ld.matrix(ld.blk(il, "attn_kv.weight"), E, D);
    L.attn_kv_norm = ld.vector(ld.blk(il, "attn_kv_a_norm.weight"), D);
    L.wo_a.w =
        ld.matrix(ld.blk(il, "attn_output_a.weight"), h.n_head * D / h.o_groups, h.o_groups * h.o_lora_rank);
    L.wo_b.w = ld.matrix(ld.blk(il, "attn_output_b.weight"), h.o_groups * h.o_lora_rank, E);
    L.hc_attn_fn.w = ld.matrix(ld.blk(il, "hc_attn_fn.weight"), n_hc * E, n_mix);
    L.hc_attn_base = ld.vector(ld.blk(il, "hc_attn_base.weight"), n_mix);
    L.hc_attn_scale = ld.vector(ld.blk(il, "hc_attn_scale.weight"), 3);
    L.hc_ffn_fn.w = ld.matrix(ld.blk(il, "hc_ffn_fn.weight"), n_hc * E, n_mix);
    L.hc_ffn_base = ld.vector(ld.blk(il, "hc_ffn_base.weight"), n_mix);
    L.hc_ffn_scale = ld.vector(ld.blk(il, "hc_ffn_scale.weight"), 3);

    const int64_t ratio = h.compress_ratios[static_cast<size_t>(il)];
    L.compress_ratio = ratio;
    if (ratio > 0) {
        const int64_t cD = (ratio == 4 ? 2 : 1) * D;
        L.comp_wkv.w = ld.matrix(ld.blk(il, "attn_compressor_kv.weight"), E, cD);
        L.comp_wgate.w = ld.matrix(ld.blk(il, "attn_compressor_gate.weight"), E, cD);
        L.comp_ape = ld.stacked_vector(ld.blk(il, "attn_compressor_ape.weight"), cD, ratio);
        L.comp_norm = ld.vector(ld.blk(il, "attn_compressor_norm.weight"), D);
    }
    if (ratio == 4) {
        const int64_t Di = h.indexer_head_dim;
        L.idx_proj.w = ld.matrix(ld.blk(il, "indexer.proj.weight"), E, h.indexer_n_head);
        L.idx_q_b.w = ld.matrix(ld.blk(il, "indexer.attn_q_b.weight"), h.n_lora_q, h.indexer_n_head * Di);
        L.idx_comp_wkv.w = ld.matrix(ld.blk(il, "indexer_compressor_kv.weight"), E, 2 * Di);
        L.idx_comp_wgate.w = ld.matrix(ld.blk(il, "indexer_compressor_gate.weight"), E, 2 * Di);
        L.idx_comp_ape = ld.stacked_vector(ld.blk(il, "indexer_compressor_ape.weight"), 2 * Di, ratio);
        L.idx_comp_norm = ld.vector(ld.blk(il, "indexer_compressor_norm.weight"), Di);
    }

    ld.moe(il);
    if (il < h.n_hash_layers) {
        L.tid2eid = ld.int_table(ld.blk(il, "ffn_gate_tid2eid.weight"), h.n_expert_used, h.n_vocab);
        for (int32_t e : L.tid2eid) {
            if (e < 0 || e >= h.n_expert) {
                throw FormatError("[model] " + ld.model().file->path() + ": tensor " +
                                  ld.blk(il, "ffn_gate_tid2eid.weight") + " names expert " +
                                  std::to_string(e) + " outside [0, " + std::to_string(h.n_expert) + ")");
            }
        }
    } else {
        L.exp_probs_b = ld.vector(ld.blk(il, "exp_probs_b.bias"), h.n_expert);
    }
    ld.shared_expert(il);
    L.expert_swiglu_clamp = h.swiglu_clamp_exp[static_cast<size_t>(il)];
    L.shexp_swiglu_clamp = h.swiglu_clamp_shexp[static_cast<size_t>(il)];
}

namespace {

Act dsv4_attention(Forward& f, const Act& cur, int il) {
    const HParams& h = f.hp();
    const LayerWeights& L = f.layer(il);
    Backend& b = f.backend();
    const int64_t T = cur.n_tokens, H = h.n_head, D = h.head_dim, n_rot = h.rope.n_rot, nope = D - n_rot;
    const int64_t Hi = h.indexer_n_head, Di = h.indexer_head_dim;
    const int64_t ratio = h.compress_ratios[static_cast<size_t>(il)];
    CompressedAttentionShape shape;
    shape.n_head = H;
    shape.head_dim = D;
    shape.window = h.n_swa;
    shape.ratio = ratio;
    shape.indexer_n_head = Hi;
    shape.indexer_head_dim = Di;
    shape.indexer_top_k = h.indexer_top_k;
    shape.scale = h.attn_scale;
    shape.eps = h.rms_eps;
    shape.rope = ratio > 0 ? h.compress_rope : h.rope;
    shape.compress_rope = h.compress_rope;

    Act qa = f.linear(cur, L.wq_a, "q_a", il);
    qa = f.norm(qa, L.attn_q_a_norm, "q_a_norm", il);
    Act q = f.linear(qa, L.wq_b, "Qcur", il);
    b.rms_norm_unweighted(q.data, q.data, D, T * H, D, h.rms_eps);
    Act kv = f.linear(cur, L.wkv, "kv", il);
    b.rms_norm(kv.data, kv.width, kv.data, kv.width, T, D, L.attn_kv_norm.data(), h.rms_eps);
    CompressedAttentionInputs in;
    Act ckv, cgate, ikv, igate, iq, iw;
    if (ratio > 0) {
        ckv = f.linear(cur, L.comp_wkv, "comp_kv", il);
        cgate = f.linear(cur, L.comp_wgate, "comp_gate", il);
        in.comp_ape = L.comp_ape.data();
        in.comp_norm = L.comp_norm.data();
        in.ld_comp = ckv.width;
    }
    if (ratio == 4) {
        ikv = f.linear(cur, L.idx_comp_wkv, "indexer_comp_kv", il);
        igate = f.linear(cur, L.idx_comp_wgate, "indexer_comp_gate", il);
        iq = f.linear(qa, L.idx_q_b, "indexer_q", il);
        iw = f.linear(cur, L.idx_proj, "indexer_weights", il);
        in.idx_ape = L.idx_comp_ape.data();
        in.idx_norm = L.idx_comp_norm.data();
        in.ld_idx = ikv.width;
        in.ld_idx_q = iq.width;
        in.ld_idx_w = iw.width;
    }
    in.ldq = q.width;
    in.ldkv = kv.width;
    in.sinks = L.attn_sinks.data();

    Act o = f.alloc(T, H * D);
    for (const SeqSpan& s : f.spans()) {
        b.rope(q.row(s.row0) + nope, q.width, s.n_tokens, H, D, s.pos0, shape.rope);
        b.rope(kv.row(s.row0) + nope, kv.width, s.n_tokens, 1, D, s.pos0, shape.rope);
        if (ratio == 4)
            b.rope(iq.row(s.row0) + (Di - n_rot), iq.width, s.n_tokens, Hi, Di, s.pos0, h.compress_rope);
        in.q = q.row(s.row0);
        in.kv = kv.row(s.row0);
        if (ratio > 0) {
            in.comp_kv = ckv.row(s.row0);
            in.comp_gate = cgate.row(s.row0);
        }
        if (ratio == 4) {
            in.idx_kv = ikv.row(s.row0);
            in.idx_gate = igate.row(s.row0);
            in.idx_q = iq.row(s.row0);
            in.idx_w = iw.row(s.row0);
        }
        b.compressed_attention(in, *s.kv, il, s.n_tokens, s.pos0, shape, o.row(s.row0), o.width);
    }
    f.name(o, "kqv_out", il);

    // Grouped output projection: group g's heads through its o_lora_rank rows of wo_a.
    const int64_t G = h.o_groups, R = h.o_lora_rank, in_g = H * D / G;
    Act y = f.alloc(T, G * R);
    for (int64_t g = 0; g < G; ++g) {
        WeightView w = L.wo_a.w;
        w.data += static_cast<size_t>(g * R) * w.row_bytes;
        w.n_rows = R;
        b.matmul(w, o.data + g * in_g, o.width, T, y.data + g * R, y.width, f.exact());
    }
    f.name(y, "attn_out_a", il);
    return f.linear(y, L.wo_b, "attn_out", il);
}

// One hyper-connection around `block`: the streams of x collapse into the block's input (normed
// by `norm`), and its output spreads back over the mixed streams.
template <typename Block>
Act hyper_block(Forward& f, const Act& x, const Linear& fn, const std::vector<float>& base,
                const std::vector<float>& scale, const std::vector<float>& norm, const char* norm_name,
                int il, Block block) {
    const HParams& h = f.hp();
    const int64_t T = x.n_tokens, n_hc = h.hc_mult, E = h.n_embd;
    Backend& b = f.backend();
    Act flat = f.alloc(T, x.width);
    b.rms_norm_unweighted(x.data, flat.data, x.width, T, x.width, h.rms_eps);
    Act mixes = f.linear(flat, fn, "hc_mixes", il);
    Act pre = f.alloc(T, n_hc), post = f.alloc(T, n_hc), comb = f.alloc(T, n_hc * n_hc);
    b.hc_block_weights(mixes.data, T, n_hc, base.data(), scale.data(), h.hc_eps, h.hc_sinkhorn_iters,
                       pre.data, post.data, comb.data);
    Act collapsed = f.alloc(T, E);
    b.hc_collapse(x.data, T, n_hc, E, pre.data, collapsed.data);
    Act cur = f.norm(collapsed, norm, norm_name, il);
    Act out = block(cur, collapsed);
    Act y = f.alloc(T, x.width);
    b.hc_expand(x.data, out.data, T, n_hc, E, post.data, comb.data, y.data);
    return y;
}

}  // namespace

static Act build_deepseek4_layer(Forward& f, const Act& inp, int il) {
    if (!f.backend().host_memory())
        throw UnsupportedError(
            "[model] deepseek4 runs on the CPU backend only (hyper-connections, compressed attention)");
    const LayerWeights& L = f.layer(il);
    Act x = hyper_block(f, inp, L.hc_attn_fn, L.hc_attn_base, L.hc_attn_scale, L.attn_norm, "attn_norm", il,
                        [&](const Act& cur, const Act&) { return dsv4_attention(f, cur, il); });
    f.name(x, "ffn_inp", il);
    Act y =
        hyper_block(f, x, L.hc_ffn_fn, L.hc_ffn_base, L.hc_ffn_scale, L.ffn_norm, "ffn_norm", il,
                    [&](const Act& cur, const Act& collapsed) { return f.moe_ffn(cur, collapsed.data, il); });
    f.name(y, "l_out", il);
    return y;
}

extern const ArchSpec kArchDeepseek4{
    "deepseek4",          RopeType::normal,      /*expert_weights_norm=*/true,
    load_deepseek4_layer, build_deepseek4_layer, Gating::sqrt_softplus};

}  // namespace sharpi
