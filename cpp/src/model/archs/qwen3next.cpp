// qwen3next: Qwen3-Next-80B-A3B. Hybrid layers (model/hybrid_layer.h): Gated DeltaNet on three of
// every four layers, gated attention with per-head q/k RMSNorm and partial NeoX RoPE on the rest;
// every layer routed experts (softmax router, top-k renormalised, as llama.cpp hard-codes) plus a
// sigmoid-gated shared expert. Value heads stay grouped by key head, as in the checkpoint.
#include "model/arch.h"
#include "model/forward.h"
#include "model/hybrid_layer.h"
#include "model/model.h"

namespace sharpi {

static void load_qwen3next_layer(ModelLoader& ld, int il) {
    load_hybrid_layer(ld, il, /*v_heads_tiled=*/false);
}

static Act build_qwen3next_layer(Forward& f, const Act& inp, int il) {
    return f.decoder_layer(inp, il, QkNorm::per_head);  // DeltaNet on recurrent layers
}

extern const ArchSpec kArchQwen3Next{"qwen3next", RopeType::neox, /*expert_weights_norm=*/true,
                                     load_qwen3next_layer, build_qwen3next_layer};

}  // namespace sharpi
