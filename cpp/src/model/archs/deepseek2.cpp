// deepseek2: DeepSeek-V2 / V2-Lite / V3 / R1 and models built on them (Kimi K2).
//
// Attention is multi-head latent attention (MLA). Each token's KV is compressed to one latent
// c = RMSNorm(W_kv_a x)[:kv_lora_rank] plus one RoPE key k_pe shared by all heads; the cache holds
// only [c, k_pe] per position (kv_lora_rank + n_rot elements of cache_type_k instead of
// 2 * n_head * head_dim; V is the same row, as in llama.cpp). The converter stores the
// up-projection kv_b split per head into W_kb (absorbed into the query: q_abs_h = [W_kb_h^T
// q_nope_h, q_pe_h]) and W_vb (applied to the attention-weighted latent), which is the absorbed form
// llama.cpp runs; sharpi uses it for prefill and decode alike, so both take the same arithmetic per
// token. q comes from one projection, or through a LoRA (W_q_a, RMSNorm, W_q_b)
// when attention.q_lora_rank is set. RoPE pairs adjacent dimensions ("normal"), as DeepSeek's
// interleaved rotary layout does.
//
// FFN: the first leading_dense_block_count layers are dense SwiGLU; the rest route over experts
// (softmax with group-limited greedy top-k for V2, sigmoid + exp_probs_b selection bias + group
// top-k for V3; cpu/ops/router.h), scale the top-k weights by expert_weights_scale, and add the
// shared experts' output unscaled.
#include <cmath>
#include <vector>

#include "model/arch.h"
#include "model/archs/mla.h"
#include "model/forward.h"
#include "model/model.h"
#include "sharpi/errors.h"

namespace sharpi {

void load_mla_layer(ModelLoader& ld, int il) {
    const HParams& h = ld.hp();
    LayerWeights& L = ld.layer(il);
    if (!h.is_mla()) {
        throw UnsupportedError("[model] " + ld.model().file->path() + ": " + h.arch +
                               " without attention.kv_lora_rank (non-MLA) is not supported");
    }
    const int64_t n_embd_q = h.n_head * h.n_embd_head_k_mla;
    const int64_t qk_nope = h.n_embd_head_k_mla - h.rope.n_rot;
    L.attn_norm = ld.vector(ld.blk(il, "attn_norm.weight"), h.n_embd);
    if (h.n_lora_q > 0) {
        L.wq_a.w = ld.matrix(ld.blk(il, "attn_q_a.weight"), h.n_embd, h.n_lora_q);
        L.attn_q_a_norm = ld.vector(ld.blk(il, "attn_q_a_norm.weight"), h.n_lora_q);
        L.wq_b.w = ld.matrix(ld.blk(il, "attn_q_b.weight"), h.n_lora_q, n_embd_q);
    } else {
        L.wq.w = ld.matrix(ld.blk(il, "attn_q.weight"), h.n_embd, n_embd_q);
    }
    L.wkv_a_mqa.w = ld.matrix(ld.blk(il, "attn_kv_a_mqa.weight"), h.n_embd, h.n_lora_kv + h.rope.n_rot);
    L.attn_kv_a_norm = ld.vector(ld.blk(il, "attn_kv_a_norm.weight"), h.n_lora_kv);
    if (!ld.model().file->find_tensor(ld.blk(il, "attn_k_b.weight")) &&
        ld.model().file->find_tensor(ld.blk(il, "attn_kv_b.weight"))) {
        throw UnsupportedError("[model] " + ld.model().file->path() + ": tensor " +
                               ld.blk(il, "attn_kv_b.weight") +
                               " without attn_k_b / attn_v_b: an old conversion; re-convert with a current "
                               "llama.cpp convert_hf_to_gguf.py");
    }
    L.wk_b = ld.stacked_matrix(ld.blk(il, "attn_k_b.weight"), qk_nope, h.n_lora_kv, h.n_head);
    L.wv_b = ld.stacked_matrix(ld.blk(il, "attn_v_b.weight"), h.n_lora_kv, h.n_embd_head_v_mla, h.n_head);
    L.wo.w = ld.matrix(ld.blk(il, "attn_output.weight"), h.n_head * h.n_embd_head_v_mla, h.n_embd);
    if (h.has_indexer()) load_dsa_indexer(ld, il);
    if (il < h.n_layer_dense_lead || !h.is_moe()) {
        ld.dense_ffn(il);
        return;
    }
    ld.moe(il);
    L.exp_probs_b = ld.optional_vector(ld.blk(il, "exp_probs_b.bias"), h.n_expert);
    ld.shared_expert(il);
}

namespace {

// Head h's block of a head-major stack of [n_rows, n_cols] matrices.
WeightView head_matrix(const WeightView& stack, int64_t h, int64_t n_rows) {
    WeightView w = stack;
    w.data += static_cast<size_t>(h * n_rows) * stack.row_bytes;
    w.n_rows = n_rows;
    return w;
}

}  // namespace

Act mla_self_attention(Forward& f, const Act& cur, int il) {
    const HParams& h = f.hp();
    const LayerWeights& L = f.layer(il);
    const int64_t T = cur.n_tokens, n_head = h.n_head, n_rot = h.rope.n_rot, n_lora_kv = h.n_lora_kv;
    const int64_t head_k = h.n_embd_head_k_mla, qk_nope = head_k - n_rot, head_v = h.n_embd_head_v_mla;
    const int64_t key_width = n_lora_kv + n_rot;

    Act q, qa;
    if (h.n_lora_q > 0) {
        qa = f.linear(cur, L.wq_a, "q_a", il);
        qa = f.norm(qa, L.attn_q_a_norm, "q_a_norm", il);
        q = f.linear(qa, L.wq_b, "Qcur", il);
    } else {
        q = f.linear(cur, L.wq, "Qcur", il);
    }
    Backend& b = f.backend();
    Act kv = f.linear(cur, L.wkv_a_mqa, "kv_cmpr_pe", il);  // [T, kv_lora_rank + n_rot]
    b.rms_norm(kv.data, kv.width, kv.data, kv.width, T, n_lora_kv, L.attn_kv_a_norm.data(), h.rms_eps);
    // RoPE at position pos0 + rope_shift (the MTP block's pairs, model/mtp.h); KV rows at pos0.
    for (const SeqSpan& s : f.spans()) {
        const int64_t rope_pos0 = s.pos0 + s.rope_shift;
        b.rope(q.row(s.row0) + qk_nope, q.width, s.n_tokens, n_head, head_k, rope_pos0, h.rope);
        b.rope(kv.row(s.row0) + n_lora_kv, kv.width, s.n_tokens, 1, key_width, rope_pos0, h.rope);
    }
    f.name(q, "Qcur_rope", il);
    f.name(kv, "kv_cmpr_pe_rope", il);
    // The cached row: the latent and RoPE key, then (DSA) the indexer's key.
    Act row = kv;
    if (h.has_indexer()) {
        const Act keys = dsa_indexer_keys(f, cur, il);
        row = f.alloc(T, key_width + keys.width);
        b.copy_rows(kv.data, kv.width, row.data, row.width, T, key_width);
        b.copy_rows(keys.data, keys.width, row.data + key_width, row.width, T, keys.width);
    }
    // Rounded to the cache's type (kv_layout: cache_type_k; f32 is a plain copy), per sequence.
    for (const SeqSpan& s : f.spans()) {
        b.kv_store(*s.kv, il, s.pos0, Act{row.row(s.row0), s.n_tokens, row.width}, nullptr);
    }
    std::vector<int32_t> positions, count;
    if (h.has_indexer()) dsa_select(f, cur, qa, il, &positions, &count);

    // Absorb each head's key up-projection into its query; the RoPE part is copied beside it.
    Act q_abs = f.alloc(T, n_head * key_width);
    for (int64_t hd = 0; hd < n_head; ++hd) {
        b.matmul(head_matrix(L.wk_b, hd, n_lora_kv), q.data + hd * head_k, q.width, T,
                 q_abs.data + hd * key_width, q_abs.width, f.exact());
        b.copy_rows(q.data + hd * head_k + qk_nope, q.width, q_abs.data + hd * key_width + n_lora_kv,
                    q_abs.width, T, n_rot);
    }
    Act lat = f.alloc(T, n_head * n_lora_kv);
    MlaShape shape{n_head, n_lora_kv, n_rot, h.attn_scale};
    for (const SeqSpan& s : f.spans()) {
        const MlaSelection selection{positions.data() + s.row0 * h.indexer_top_k, count.data() + s.row0,
                                     h.indexer_top_k};
        b.mla_attention(q_abs.row(s.row0), q_abs.width, *s.kv, il, s.n_tokens, s.pos0, shape,
                        h.has_indexer() ? &selection : nullptr, lat.row(s.row0), lat.width);
    }
    f.name(lat, "kqv_latent", il);

    Act v = f.alloc(T, n_head * head_v);
    for (int64_t hd = 0; hd < n_head; ++hd) {
        b.matmul(head_matrix(L.wv_b, hd, head_v), lat.data + hd * n_lora_kv, lat.width, T,
                 v.data + hd * head_v, v.width, f.exact());
    }
    f.name(v, "kqv_out", il);
    return f.linear(v, L.wo, "attn_out", il);
}

static Act build_deepseek2_layer(Forward& f, const Act& inp, int il) {
    return f.decoder_layer(inp, il, [&f, il](const Act& cur) { return mla_self_attention(f, cur, il); });
}

extern const ArchSpec kArchDeepseek2{"deepseek2", RopeType::normal, /*expert_weights_norm=*/false,
                                     load_mla_layer, build_deepseek2_layer};

}  // namespace sharpi
