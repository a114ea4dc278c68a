// qwen3moe: Qwen3-MoE (Qwen3-30B-A3B). No attention biases; q and k get an RMSNorm per head
// (weights of head_dim) before NeoX RoPE; head_dim is explicit (attention.key_length, 128 while
// n_embd / n_head = 64 in the 30B model). Softmax router, top-k weights renormalised.
#include "model/arch.h"
#include "model/forward.h"
#include "model/model.h"

namespace sharpi {

static void load_qwen3moe_layer(ModelLoader& ld, int il) {
    ld.attention(il);
    ld.qk_norm(il, ld.hp().head_dim, ld.hp().head_dim);
    ld.moe(il);
}

static Act build_qwen3moe_layer(Forward& f, const Act& inp, int il) {
    return f.decoder_layer(inp, il, QkNorm::per_head);
}

extern const ArchSpec kArchQwen3Moe{"qwen3moe", RopeType::neox, /*expert_weights_norm=*/true,
                                    load_qwen3moe_layer, build_qwen3moe_layer};

}  // namespace sharpi
