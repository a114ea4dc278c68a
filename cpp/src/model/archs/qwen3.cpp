// qwen3: dense Qwen3. Per-head q/k RMSNorm before NeoX RoPE, explicit head_dim, SwiGLU FFN.
#include "model/arch.h"
#include "model/forward.h"
#include "model/model.h"

namespace sharpi {

static void load_qwen3_layer(ModelLoader& ld, int il) {
    ld.attention(il);
    ld.qk_norm(il, ld.hp().head_dim, ld.hp().head_dim);
    ld.dense_ffn(il);
}

static Act build_qwen3_layer(Forward& f, const Act& inp, int il) {
    return f.decoder_layer(inp, il, QkNorm::per_head);
}

extern const ArchSpec kArchQwen3{"qwen3", RopeType::neox, /*expert_weights_norm=*/false, load_qwen3_layer,
                                 build_qwen3_layer};

}  // namespace sharpi
