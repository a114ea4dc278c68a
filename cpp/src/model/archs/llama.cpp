// llama: Llama-style decoder, and Mixtral when the file has experts (llama.cpp writes Mixtral with
// architecture "llama"). Pre-norm RMSNorm blocks, GQA, "normal" RoPE on adjacent pairs (the
// converter permutes the q/k rows of each head so that this pairing reproduces HF's rotate_half),
// SwiGLU FFN or a softmax router whose top-k weights are renormalised to sum 1.
#include "model/arch.h"
#include "model/forward.h"
#include "model/model.h"

namespace sharpi {

static void load_llama_layer(ModelLoader& ld, int il) {
    ld.attention(il);
    if (ld.hp().is_moe()) {
        ld.moe(il);
    } else {
        ld.dense_ffn(il);
    }
}

static Act build_llama_layer(Forward& f, const Act& inp, int il) {
    return f.decoder_layer(inp, il, QkNorm::none);
}

extern const ArchSpec kArchLlama{"llama", RopeType::normal, /*expert_weights_norm=*/true, load_llama_layer,
                                 build_llama_layer};

}  // namespace sharpi
