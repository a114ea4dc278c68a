// qwen2moe: Qwen1.5-MoE / Qwen2-MoE. Attention with q/k/v biases and NeoX RoPE; every layer has
// routed experts (softmax router, top-k weights NOT renormalised) plus one shared expert that is
// always on, scaled by sigmoid(ffn_gate_inp_shexp . x).
#include "model/arch.h"
#include "model/forward.h"
#include "model/model.h"

namespace sharpi {

static void load_qwen2moe_layer(ModelLoader& ld, int il) {
    ld.attention(il);  // loads the q/k/v biases
    ld.moe(il);
    ld.shared_expert(il);
}

static Act build_qwen2moe_layer(Forward& f, const Act& inp, int il) {
    return f.decoder_layer(inp, il, QkNorm::none);  // moe_ffn adds the shared expert
}

extern const ArchSpec kArchQwen2Moe{"qwen2moe", RopeType::neox, /*expert_weights_norm=*/false,
                                    load_qwen2moe_layer, build_qwen2moe_layer};

}  // namespace sharpi
