// glm4moe: GLM-4.5, GLM-4.5-Air, GLM-4.6 and GLM-4.7 (Zhipu / Z.ai; llama.cpp's LLM_ARCH_GLM4_MOE).
//
// Attention: q/k/v with biases, an optional per-head RMSNorm of q and k (attn_q_norm / attn_k_norm
// of head_dim, present in the files converted from checkpoints with use_qk_norm), and partial RoPE:
// NeoX pairing (i, i + n_rot/2) on the first rope.dimension_count = head_dim * partial_rotary_factor
// dimensions of each head; the rest pass through. head_dim is explicit (attention.key_length, 128
// while n_embd / n_head is 32 in GLM-4.5-Air).
//
// FFN: the norm before it is post_attention_norm. The first leading_dense_block_count layers are
// dense SwiGLU; the others route over experts with sigmoid scores, choose the top-k on
// score + exp_probs_b (the selection bias, which does not enter the weights), renormalise the k
// weights when expert_weights_norm, scale them by expert_weights_scale (routed_scaling_factor),
// and add the shared expert's output ungated.
//
// MTP: block_count includes nextn_predict_layers multi-token-prediction blocks after the trunk
// (blk.n_layer ...: a full MoE decoder layer plus nextn.eh_proj / enorm / hnorm and optional
// shared_head_*). hparams.cpp takes them off the trunk and load_model leaves their tensors in the
// file unread (model.h is_nextn_tensor); they are not run here.
//
// Files with rope.dimension_sections (GLM-4.5V, multimodal M-RoPE) are refused: the text-only
// positions sharpi feeds would be plain RoPE, but llama.cpp itself runs those files with M-RoPE
// pairing, which this file does not implement.
#include "gguf/gguf_file.h"
#include "model/arch.h"
#include "model/forward.h"
#include "model/model.h"
#include "sharpi/errors.h"

namespace sharpi {

static void load_glm4moe_layer(ModelLoader& ld, int il) {
    const HParams& h = ld.hp();
    LayerWeights& L = ld.layer(il);
    const GgufFile& f = *ld.model().file;
    if (il == 0) {
        if (!h.is_moe()) {
            throw FormatError("[model] " + f.path() + ": glm4moe needs glm4moe.expert_count > 0");
        }
        if (const GgufValue* sections = f.find("glm4moe.rope.dimension_sections")) {
            const bool mrope =
                sections->arr_int.size() >= 2 && sections->arr_int[0] > 0 && sections->arr_int[1] > 0;
            if (mrope) {
                throw UnsupportedError("[model] " + f.path() +
                                       ": glm4moe with rope.dimension_sections (multimodal M-RoPE, GLM-4.5V) "
                                       "is not supported");
            }
        }
    }
    ld.attention(il);  // loads the q/k/v biases
    L.attn_q_norm = ld.optional_vector(ld.blk(il, "attn_q_norm.weight"), h.head_dim);
    L.attn_k_norm = ld.optional_vector(ld.blk(il, "attn_k_norm.weight"), h.head_dim);
    if (L.attn_q_norm.empty() != L.attn_k_norm.empty()) {
        throw MissingTensorError("[model] " + f.path() + ": layer " + std::to_string(il) +
                                 " has only one of attn_q_norm / attn_k_norm");
    }
    if (il < h.n_layer_dense_lead) {
        ld.dense_ffn(il, "post_attention_norm.weight");
        return;
    }
    ld.moe(il, "post_attention_norm.weight");
    L.exp_probs_b = ld.vector(ld.blk(il, "exp_probs_b.bias"), h.n_expert);
    ld.shared_expert(il);  // no ffn_gate_inp_shexp: the shared expert is added ungated
}

static Act build_glm4moe_layer(Forward& f, const Act& inp, int il) {
    // moe_ffn adds the shared expert.
    const QkNorm qk_norm = f.layer(il).attn_q_norm.empty() ? QkNorm::none : QkNorm::per_head;
    return f.decoder_layer(inp, il, qk_norm);
}

// Routing defaults to sigmoid when the file has no expert_gating_func (llama.cpp's default for it).
extern const ArchSpec kArchGlm4Moe{"glm4moe",          RopeType::neox,      /*expert_weights_norm=*/false,
                                   load_glm4moe_layer, build_glm4moe_layer, Gating::sigmoid};

}  // namespace sharpi
