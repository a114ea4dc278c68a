// llama4: Llama 4 Scout (17B-16E) and Maverick (17B-128E), the text model (llama.cpp's
// LLM_ARCH_LLAMA4; the vision tower goes to a separate mmproj file and is never read here).
//
// Attention: GQA with "normal" RoPE on adjacent pairs (the converter does not permute q/k: Meta's
// rotary is complex multiplication of interleaved pairs), with llama3-style frequency factors when
// the file carries rope_freqs. Layers come in groups of four (llama.cpp's swa pattern 4): the first
// three rotate q/k and attend only within their chunk of 8192 positions (chunked local attention,
// llama.cpp's LLAMA_SWA_TYPE_CHUNKED: position p reads [floor(p / 8192) * 8192, p]); every fourth is
// a global NoPE layer (no RoPE, all positions) whose queries are scaled by the attention temperature
// ln(floor((p + 1) / 8192) + 1) * 0.1 + 1. The RoPE layers L2-normalise q and k per head after RoPE
// (an RMSNorm without weight, eps rms_eps), except in 128-expert files (Maverick), as llama.cpp
// decides. The converter writes none of these numbers; llama.cpp hard-codes them, and so do we.
// A file with attention.sliding_window = 0 (MobileLLM-style, all global) chunks nothing and skips
// RoPE only on its last layer, as llama.cpp's rule does, with no temperature.
//
// FFN: layers il with (il + 1) % interleave_moe_layer_step == 0 are MoE, the others a dense
// SwiGLU of feed_forward_length. A MoE layer's router picks the top-1 (expert_used_count) expert
// by its raw logit (RouterParams::rank_logits); its weight sigmoid(logit) multiplies the expert's INPUT
// (moe/moe_ffn.cpp, LayerWeights::expert_input_weighted), and an always-on shared expert of the routed
// experts' width is added unscaled. llama.cpp uses sigmoid gating without renormalisation whatever the
// metadata says; so do we (set on the model's router when the first layer loads).
#include <cmath>
#include <string>
#include <vector>

#include "gguf/gguf_file.h"
#include "model/arch.h"
#include "model/forward.h"
#include "model/model.h"
#include "sharpi/errors.h"

namespace sharpi {

namespace {

// llama.cpp's llama4 constants (llama_model_llama4::load_arch_hparams).
constexpr int64_t kChunkSize = 8192;
constexpr int64_t kLayerPattern = 4;  // 3 chunked RoPE layers, then 1 global NoPE layer
constexpr int64_t kTempFloorScale = 8192;
constexpr float kTempScale = 0.1f;
constexpr int64_t kNoQkNormExperts = 128;  // Maverick (LLM_TYPE_17B_128E) has no q/k norm

bool is_moe_layer(int64_t step, int il) {
    return step > 0 && (il + 1) % step == 0;
}

}  // namespace

static void load_llama4_layer(ModelLoader& ld, int il) {
    HParams& h = ld.model().hp;
    const GgufFile& f = *ld.model().file;
    LayerWeights& L = ld.layer(il);
    const std::string where = "[model] " + f.path() + ": ";
    if (h.n_expert == 0) throw FormatError(where + "llama4 without experts (expert_count 0)");
    if (il == 0) {
        h.router.gating = Gating::sigmoid;
        h.router.rank_logits = true;
        h.router.normalize_topk = false;
        h.expert_weights_norm = false;
        h.n_ff_shexp = h.n_ff_exp;  // every MoE layer's shared expert (no key in the file)
    }
    const int64_t step = static_cast<int64_t>(f.get_uint("llama4.interleave_moe_layer_step"));
    const bool chunked = f.get_uint_or("llama4.attention.sliding_window", 1) != 0;

    ld.attention(il);
    if (chunked) {
        L.attn_rope = il % kLayerPattern < kLayerPattern - 1;
        L.attn_chunk = L.attn_rope ? kChunkSize : 0;
        if (!L.attn_rope) {
            L.attn_temp_floor_scale = kTempFloorScale;
            L.attn_temp_scale = kTempScale;
        }
    } else {
        L.attn_rope = (il + 1) % h.n_layer != 0;
    }
    if (L.attn_rope && h.n_expert != kNoQkNormExperts) {
        // The L2 norm is an RMSNorm with unit weights (x * 1.0f is exact).
        L.attn_q_norm.assign(static_cast<size_t>(h.head_dim), 1.0f);
        L.attn_k_norm.assign(static_cast<size_t>(h.head_dim), 1.0f);
    }
    L.rope_freqs = ld.optional_vector("rope_freqs.weight", h.rope.n_rot / 2);

    if (is_moe_layer(step, il)) {
        ld.moe(il);
        L.expert_input_weighted = true;
        // The shared expert is as wide as a routed one (llama.cpp: n_ff_shexp = n_ff_exp).
        L.ffn_gate.w = ld.matrix(ld.blk(il, "ffn_gate_shexp.weight"), h.n_embd, h.n_ff_exp);
        L.ffn_up.w = ld.matrix(ld.blk(il, "ffn_up_shexp.weight"), h.n_embd, h.n_ff_exp);
        L.ffn_down.w = ld.matrix(ld.blk(il, "ffn_down_shexp.weight"), h.n_ff_exp, h.n_embd);
    } else {
        ld.dense_ffn(il);
    }
}

// q/k/v, RoPE (or the temperature), the L2 q/k norm, KV append and (chunked) causal attention,
// span by span at each sequence's absolute positions.
static Act llama4_attention(Forward& f, const Act& cur, int il) {
    const HParams& h = f.hp();
    const LayerWeights& L = f.layer(il);
    Backend& b = f.backend();
    const int64_t T = cur.n_tokens;
    Act q = f.linear(cur, L.wq, "Qcur", il);
    Act k = f.linear(cur, L.wk, "Kcur", il);
    Act v = f.linear(cur, L.wv, "Vcur", il);

    RopeParams rope = h.rope;
    if (!L.rope_freqs.empty()) rope.freq_factors = L.rope_freqs.data();
    std::vector<float> temperature;
    for (const SeqSpan& s : f.spans()) {
        if (L.attn_rope) {
            b.rope(q.row(s.row0), q.width, s.n_tokens, h.n_head, h.head_dim, s.pos0, rope);
            b.rope(k.row(s.row0), k.width, s.n_tokens, h.n_head_kv, h.head_dim, s.pos0, rope);
        } else if (L.attn_temp_floor_scale > 0) {
            temperature.resize(static_cast<size_t>(s.n_tokens));
            for (int64_t t = 0; t < s.n_tokens; ++t) {
                const double blocks =
                    std::floor(static_cast<double>(s.pos0 + t + 1) / L.attn_temp_floor_scale);
                temperature[static_cast<size_t>(t)] =
                    static_cast<float>(std::log(blocks + 1.0) * L.attn_temp_scale + 1.0);
            }
            b.scale_rows(Act{q.row(s.row0), s.n_tokens, q.width}, temperature.data());
        }
    }
    f.name(q, "Qcur_pos", il);
    f.name(k, "Kcur_pos", il);
    if (!L.attn_q_norm.empty()) {
        b.rms_norm(q.data, h.head_dim, q.data, h.head_dim, T * h.n_head, h.head_dim, L.attn_q_norm.data(),
                   h.rms_eps);
        b.rms_norm(k.data, h.head_dim, k.data, h.head_dim, T * h.n_head_kv, h.head_dim, L.attn_k_norm.data(),
                   h.rms_eps);
        f.name(q, "Qcur_normed", il);
        f.name(k, "Kcur_normed", il);
    }

    Act kqv = f.alloc(T, h.n_embd_q());
    AttentionShape shape{h.n_head, h.n_head_kv, h.head_dim, h.attn_scale};
    shape.chunk = L.attn_chunk;
    shape.exact = f.exact();
    for (const SeqSpan& s : f.spans()) {
        const Act k_rows{k.row(s.row0), s.n_tokens, k.width}, v_rows{v.row(s.row0), s.n_tokens, v.width};
        b.kv_store(*s.kv, il, s.pos0, k_rows, &v_rows);
        b.attention(q.row(s.row0), q.width, *s.kv, il, s.n_tokens, s.pos0, shape, kqv.row(s.row0), kqv.width);
    }
    f.name(kqv, "kqv_out", il);
    return f.linear(kqv, L.wo, "attn_out", il);
}

static Act build_llama4_layer(Forward& f, const Act& inp, int il) {
    // decoder_layer runs moe_ffn (routed experts plus the shared expert) or the dense FFN.
    return f.decoder_layer(inp, il, [&](const Act& cur) { return llama4_attention(f, cur, il); });
}

extern const ArchSpec kArchLlama4{"llama4", RopeType::normal, /*expert_weights_norm=*/false,
                                  load_llama4_layer, build_llama4_layer};

}  // namespace sharpi
