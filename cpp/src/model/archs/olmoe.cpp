// olmoe: OLMoE-1B-7B. q and k get an RMSNorm over the whole projection (weights of
// n_head * head_dim and n_head_kv * head_dim) before they are split into heads; NeoX RoPE;
// softmax router over 64 experts, top-8 weights NOT renormalised.
#include "model/arch.h"
#include "model/forward.h"
#include "model/model.h"

namespace sharpi {

static void load_olmoe_layer(ModelLoader& ld, int il) {
    ld.attention(il);
    ld.qk_norm(il, ld.hp().n_embd_q(), ld.hp().n_embd_kv());
    ld.moe(il);
}

static Act build_olmoe_layer(Forward& f, const Act& inp, int il) {
    return f.decoder_layer(inp, il, QkNorm::full);
}

extern const ArchSpec kArchOlmoe{"olmoe", RopeType::neox, /*expert_weights_norm=*/false, load_olmoe_layer,
                                 build_olmoe_layer};

}  // namespace sharpi
