// qwen2: dense Qwen2 / Qwen2.5. Attention with q/k/v biases, NeoX RoPE, SwiGLU FFN.
#include "model/arch.h"
#include "model/forward.h"
#include "model/model.h"

namespace sharpi {

static void load_qwen2_layer(ModelLoader& ld, int il) {
    ld.attention(il);
    ld.dense_ffn(il);
}

static Act build_qwen2_layer(Forward& f, const Act& inp, int il) {
    return f.decoder_layer(inp, il, QkNorm::none);
}

extern const ArchSpec kArchQwen2{"qwen2", RopeType::neox, /*expert_weights_norm=*/false, load_qwen2_layer,
                                 build_qwen2_layer};

}  // namespace sharpi
