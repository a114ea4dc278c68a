// minimax-m2: MiniMax-M2 (MiniMax, 230B-A10B; llama.cpp's LLM_ARCH_MINIMAX_M2).
//
// Attention: GQA without biases. q and k each get an RMSNorm over the whole projection (weights of
// n_head * head_dim and n_head_kv * head_dim, as olmoe) before they are split into heads, then
// partial NeoX RoPE: pairing (i, i + n_rot/2) on the first rope.dimension_count dimensions of each
// head (rotary_dim 64 of head_dim 128 in MiniMax-M2); the rest pass through. head_dim is explicit
// (attention.key_length: 128 while n_embd / n_head is 64).
//
// FFN: every layer is MoE, no shared expert. The router scores are sigmoid (llama.cpp reads
// expert_gating_func, which the converter writes from the config's scoring_func; transformers
// always uses sigmoid, so a file without the key is read as sigmoid); the top-k is chosen on
// score + exp_probs_b (e_score_correction_bias, which does not enter the weights) and the k
// weights are renormalised to sum to 1 (llama.cpp hard-codes this for minimax-m2).
//
// MTP: MiniMax-M2's config declares MTP modules (num_mtp_modules), but neither transformers nor
// llama.cpp's converter carries them: its files hold no nextn blocks, so there is nothing to load.
#include "gguf/gguf_file.h"
#include "model/arch.h"
#include "model/forward.h"
#include "model/model.h"
#include "sharpi/errors.h"

namespace sharpi {

static void load_minimax_m2_layer(ModelLoader& ld, int il) {
    const HParams& h = ld.hp();
    if (il == 0 && !h.is_moe()) {
        throw FormatError("[model] " + ld.model().file->path() +
                          ": minimax-m2 needs minimax-m2.expert_count > 0");
    }
    ld.attention(il);
    ld.qk_norm(il, h.n_embd_q(), h.n_embd_kv());
    ld.moe(il);
    ld.layer(il).exp_probs_b = ld.vector(ld.blk(il, "exp_probs_b.bias"), h.n_expert);
}

static Act build_minimax_m2_layer(Forward& f, const Act& inp, int il) {
    return f.decoder_layer(inp, il, QkNorm::full);
}

extern const ArchSpec kArchMinimaxM2{
    "minimax-m2",          RopeType::neox,         /*expert_weights_norm=*/true,
    load_minimax_m2_layer, build_minimax_m2_layer, Gating::sigmoid};

}  // namespace sharpi
