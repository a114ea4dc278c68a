// Multi-head latent attention shared by the DeepSeek architecture files: deepseek2 defines the layer
// loader and the attention (model/archs/deepseek2.cpp); deepseek32 adds DeepSeek Sparse Attention's
// lightning indexer to both (model/archs/deepseek32.cpp), which the attention calls when the model
// has one (HParams::has_indexer).
#pragma once

#include <cstdint>
#include <vector>

#include "model/forward.h"
#include "model/model.h"

namespace sharpi {

// deepseek2's layer: MLA attention tensors, then the dense FFN (leading layers) or the routed and
// shared experts with the optional selection bias.
void load_mla_layer(ModelLoader& ld, int il);
// MLA self-attention from the normalised input cur [T, n_embd] -> [T, n_embd]; under DSA every token
// attends only to the positions the indexer selects.
Act mla_self_attention(Forward& f, const Act& cur, int il);

// The indexer's tensors of layer il (blk.N.indexer.*).
void load_dsa_indexer(ModelLoader& ld, int il);
// The indexer keys of the step's tokens: LayerNorm(indexer_attn_k cur) with NeoX RoPE on the first
// n_rot dimensions, [T, indexer_head_dim]; cached beside each token's latent.
Act dsa_indexer_keys(Forward& f, const Act& cur, int il);
// Selects each token's attended positions (the step's keys already cached): positions [T, top_k]
// ascending and count [T], host memory, span by span.
void dsa_select(Forward& f, const Act& cur, const Act& q_lora, int il, std::vector<int32_t>* positions,
                std::vector<int32_t>* count);

}  // namespace sharpi
