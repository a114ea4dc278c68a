// nemotron_h_moe: NVIDIA Nemotron-H MoE (Nemotron 3 Nano 30B-A3B; llama.cpp's LLM_ARCH_NEMOTRON_H_MOE).
//
// A hybrid stack of single-mixer blocks, out = x + mixer(rms_norm(x)) with the block's attn_norm,
// the mixer chosen per block by the file's per-layer arrays (hparams.h): Mamba-2 (head_count_kv and
// feed_forward_length both 0; model/mamba2_layer.h), attention (head_count_kv > 0: GQA without
// RoPE, no biases, softmax scale 1/sqrt(head_dim)) or MoE (feed_forward_length > 0).
//
// MoE: routed experts without a gate, down(relu(up x)^2), and one shared expert of the same form;
// sigmoid router scores (llama.cpp hard-codes sigmoid for this arch and the converter writes no
// expert_gating_func), top-k chosen on score + exp_probs_b (e_score_correction_bias), the k
// weights renormalised when expert_weights_norm and scaled by expert_weights_scale
// (routed_scaling_factor).
//
// Latent MoE (Nemotron 3 Super, moe_latent_size): the routed experts run on ffn_latent_down x, their
// weighted sum goes through ffn_latent_up; the router and the shared expert read x.
//
// Refused (UnsupportedError) rather than approximated: group-limited routing (expert_group_count
// > 1, which llama.cpp's graph ignores but transformers applies).
//
// The MTP block (Nemotron 3 Super; model/mtp.h) is one block of both kinds, attention then MoE, each
// a residual sub-layer: x += attn(rms_norm(x, attn_norm)); x += moe(rms_norm(x, post_attention_norm)).
#include "gguf/gguf_file.h"
#include "model/arch.h"
#include "model/forward.h"
#include "model/mamba2_layer.h"
#include "model/model.h"
#include "sharpi/errors.h"

namespace sharpi {

// The routed and shared relu^2 experts of block il, whose input norm is `norm`.
static void load_nemotron_moe(ModelLoader& ld, int il, const char* norm, const std::string& where) {
    const HParams& h = ld.hp();
    LayerWeights& L = ld.layer(il);
    if (!h.is_moe()) throw FormatError(where + "nemotron_h_moe needs expert_count > 0");
    if (h.n_embd_latent > 0) {
        L.ffn_latent_down.w = ld.matrix(ld.blk(il, "ffn_latent_down.weight"), h.n_embd, h.n_embd_latent);
        L.ffn_latent_up.w = ld.matrix(ld.blk(il, "ffn_latent_up.weight"), h.n_embd_latent, h.n_embd);
    } else if (ld.model().file->find_tensor(ld.blk(il, "ffn_latent_down.weight"))) {
        throw FormatError(where + "layer " + std::to_string(il) +
                          " has latent MoE projections but no moe_latent_size");
    }
    ld.moe(il, norm, /*gated=*/false);
    L.exp_probs_b = ld.vector(ld.blk(il, "exp_probs_b.bias"), h.n_expert);
    ld.shared_expert(il, /*gated=*/false);
    L.expert_relu_sqr = true;
}

static void load_nemotron_h_moe_layer(ModelLoader& ld, int il) {
    const HParams& h = ld.hp();
    const std::string where = "[model] " + ld.model().file->path() + ": ";
    if (h.ffn_only_layers.empty())
        throw FormatError(where +
                          "nemotron_h_moe needs per-layer head_count_kv and feed_forward_length arrays");
    if (il == 0 && h.router.n_group > 1) {
        throw UnsupportedError(where + "nemotron_h_moe with expert_group_count " +
                               std::to_string(h.router.n_group) +
                               " (group-limited routing) is not supported");
    }
    LayerWeights& L = ld.layer(il);
    if (h.is_recurrent(il)) {
        load_mamba2_layer(ld, il);
    } else if (h.is_ffn_only(il)) {
        load_nemotron_moe(ld, il, "attn_norm.weight", where);
        L.attn_norm = L.ffn_norm;
    } else {
        ld.attention(il);
        L.attn_rope = false;
        if (h.attention_then_moe) load_nemotron_moe(ld, il, "post_attention_norm.weight", where);
    }
}

static Act build_nemotron_h_moe_layer(Forward& f, const Act& inp, int il) {
    const HParams& h = f.hp();
    Act cur = f.norm(inp, f.layer(il).attn_norm, "attn_norm", il);
    if (h.is_recurrent(il)) {
        cur = f.mamba2(cur, il);
    } else if (h.is_ffn_only(il)) {
        cur = f.moe_ffn(cur, inp.data, il);
    } else {
        cur = f.self_attention(cur, il, QkNorm::none);
    }
    if (!h.attention_then_moe) return f.add(cur, inp, "l_out", il);
    const Act x = f.add(cur, inp, "ffn_inp", il);
    cur = f.norm(x, f.layer(il).ffn_norm, "ffn_norm", il);
    return f.add(f.moe_ffn(cur, x.data, il), x, "l_out", il);
}

extern const ArchSpec kArchNemotronHMoe{"nemotron_h_moe",
                                        RopeType::neox,
                                        /*expert_weights_norm=*/false,
                                        load_nemotron_h_moe_layer,
                                        build_nemotron_h_moe_layer,
                                        Gating::sigmoid};

}  // namespace sharpi
