// qwen35moe: Qwen3.5 / Qwen3.6 MoE (Qwen3.5-35B-A3B). The qwen3next layer (model/hybrid_layer.h)
// with beta and alpha as two projections and value heads tiled over key heads by the converter.
// Its RoPE is interleaved MRoPE (rope.dimension_sections); for text every section sees the same
// position, which makes it the plain partial NeoX RoPE computed here.
#include "model/arch.h"
#include "model/forward.h"
#include "model/hybrid_layer.h"
#include "model/model.h"

namespace sharpi {

static void load_qwen35moe_layer(ModelLoader& ld, int il) {
    load_hybrid_layer(ld, il, /*v_heads_tiled=*/true);
}

static Act build_qwen35moe_layer(Forward& f, const Act& inp, int il) {
    return f.decoder_layer(inp, il, QkNorm::per_head);  // DeltaNet on recurrent layers
}

extern const ArchSpec kArchQwen35Moe{"qwen35moe", RopeType::neox, /*expert_weights_norm=*/true,
                                     load_qwen35moe_layer, build_qwen35moe_layer};

}  // namespace sharpi
