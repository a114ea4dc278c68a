// deepseek32: DeepSeek-V3.2 / V3.2-Exp (llama.cpp's LLM_ARCH_DEEPSEEK32).
//
// deepseek2 (MLA, sigmoid routing with a selection bias, shared experts, leading dense layers; see
// deepseek2.cpp) plus DeepSeek Sparse Attention: in every layer a lightning indexer picks, for each
// query, the attention.indexer.top_k earlier positions MLA attends to (all of them while the
// sequence is no longer than top_k, which is then dense MLA exactly). The indexer has its own
// projections of the layer's input:
//
//   q_h  = (indexer_attn_q_b qr)_h        qr = attn_q_a_norm(attn_q_a x), the MLA query's LoRA
//   k    = LayerNorm(indexer_attn_k x)    (weight and bias, eps 1e-6), one key per position
//   w_h  = (indexer_proj x)_h
//   q_h and k: NeoX RoPE (pairs i, i + n_rot/2) on their first n_rot dimensions, although MLA
//   itself pairs adjacent dimensions; the rest pass through (transformers splits [rope | nope], as
//   llama.cpp's graph does)
//   score_j = sum_h w_h / sqrt(n_head_idx * head_size_idx) * relu(q_h . k_j)
//
// and the keys k_j are cached beside the MLA latent in the same KV row (model/kv_cache.h), so they
// follow truncation, forks and prefix reuse with it and the budget charges them. The selection
// arithmetic and its tie rule are cpu/ops/lightning_indexer.h's.
//
// MTP: the converter writes DeepSeek-V3.2's nextn block (a full decoder block after the trunk, with
// its own indexer tensors). MtpHead runs it as llama.cpp's graph_mtp does, as dense MLA: the
// block's indexer is not loaded and its KV rows hold no indexer key (MtpHead::block_hparams).
#include <cmath>
#include <vector>

#include "model/arch.h"
#include "model/archs/mla.h"
#include "model/forward.h"
#include "model/model.h"

namespace sharpi {

namespace {

// llama.cpp hard-codes the indexer key norm's eps (hparams.f_norm_eps), as transformers does.
constexpr float kIndexerNormEps = 1e-6f;

// The indexer's RoPE: the model's frequencies and scaling with NeoX pairing.
RopeParams indexer_rope(const HParams& h) {
    RopeParams p = h.rope;
    p.type = RopeType::neox;
    return p;
}

}  // namespace

void load_dsa_indexer(ModelLoader& ld, int il) {
    const HParams& h = ld.hp();
    LayerWeights& L = ld.layer(il);
    const int64_t n_head = h.indexer_n_head, head = h.indexer_head_dim;
    L.indexer_k_norm = ld.vector(ld.blk(il, "indexer.k_norm.weight"), head);
    L.indexer_k_norm_b = ld.vector(ld.blk(il, "indexer.k_norm.bias"), head);
    L.indexer_proj.w = ld.matrix(ld.blk(il, "indexer.proj.weight"), h.n_embd, n_head);
    L.indexer_attn_k.w = ld.matrix(ld.blk(il, "indexer.attn_k.weight"), h.n_embd, head);
    L.indexer_attn_q_b.w = ld.matrix(ld.blk(il, "indexer.attn_q_b.weight"), h.n_lora_q, n_head * head);
}

Act dsa_indexer_keys(Forward& f, const Act& cur, int il) {
    const HParams& h = f.hp();
    const LayerWeights& L = f.layer(il);
    Backend& b = f.backend();
    Act k = f.linear(cur, L.indexer_attn_k, "indexer_k", il);
    b.layer_norm(k.data, k.width, k.data, k.width, k.n_tokens, k.width, L.indexer_k_norm.data(),
                 L.indexer_k_norm_b.data(), kIndexerNormEps);
    const RopeParams rope = indexer_rope(h);
    for (const SeqSpan& s : f.spans()) {
        b.rope(k.row(s.row0), k.width, s.n_tokens, 1, k.width, s.pos0 + s.rope_shift, rope);
    }
    f.name(k, "indexer_k_rope", il);
    return k;
}

void dsa_select(Forward& f, const Act& cur, const Act& q_lora, int il, std::vector<int32_t>* positions,
                std::vector<int32_t>* count) {
    const HParams& h = f.hp();
    const LayerWeights& L = f.layer(il);
    Backend& b = f.backend();
    const int64_t n_head = h.indexer_n_head, head = h.indexer_head_dim, T = cur.n_tokens;
    Act q = f.linear(q_lora, L.indexer_attn_q_b, "indexer_q", il);
    const RopeParams rope = indexer_rope(h);
    for (const SeqSpan& s : f.spans()) {
        b.rope(q.row(s.row0), q.width, s.n_tokens, n_head, head, s.pos0 + s.rope_shift, rope);
    }
    f.name(q, "indexer_q_rope", il);
    const Act w = f.linear(cur, L.indexer_proj, "indexer_weights", il);
    IndexerShape shape;
    shape.n_head = n_head;
    shape.head_dim = head;
    shape.key_offset = h.n_lora_kv + h.rope.n_rot;
    shape.top_k = h.indexer_top_k;
    shape.weight_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n_head * head)));
    positions->assign(static_cast<size_t>(T * shape.top_k), 0);
    count->assign(static_cast<size_t>(T), 0);
    for (const SeqSpan& s : f.spans()) {
        b.lightning_indexer(q.row(s.row0), q.width, w.row(s.row0), w.width, *s.kv, il, s.n_tokens, s.pos0,
                            shape, positions->data() + s.row0 * shape.top_k, count->data() + s.row0);
    }
}

static Act build_deepseek32_layer(Forward& f, const Act& inp, int il) {
    return f.decoder_layer(inp, il, [&f, il](const Act& cur) { return mla_self_attention(f, cur, il); });
}

// The converter writes expert_gating_func (sigmoid for V3.2, whose router transformers always runs
// with sigmoid); a file without it is read as sigmoid.
extern const ArchSpec kArchDeepseek32{"deepseek32",   RopeType::normal,       /*expert_weights_norm=*/false,
                                      load_mla_layer, build_deepseek32_layer, Gating::sigmoid};

}  // namespace sharpi
