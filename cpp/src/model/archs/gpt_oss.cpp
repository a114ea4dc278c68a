// gpt-oss: OpenAI's gpt-oss-20b / 120b (llama.cpp's LLM_ARCH_OPENAI_MOE, GGUF arch "gpt-oss").
//
// Attention: q/k/v/o with biases, NeoX RoPE with YaRN from metadata (hparams.cpp), and one learned
// sink logit per head (attn_sinks) that joins every softmax denominator. Layers alternate sliding
// window and full attention: even layers attend to the last attention.sliding_window positions,
// odd layers to all (llama.cpp's swa pattern 2; transformers' layer_types likewise). The KV cache
// keeps every position for every layer (a sliding layer only reads its window).
//
// FFN: post_attention_norm, then a router with a bias choosing top-k on the logits; the weights are
// the softmax over the k selected logits (llama.cpp's SOFTMAX_WEIGHT), which equals the full
// softmax renormalised over the top-k, hence expert_weights_norm = true. Experts carry gate / up /
// down biases (resident, moe/moe_ffn.cpp) and use the clamped SwiGLU (cpu::swiglu_oai, limit 7).
#include "model/arch.h"
#include "model/forward.h"
#include "model/model.h"

namespace sharpi {

namespace {

constexpr float kSwigluLimit = 7.0f;  // transformers' GptOssConfig.swiglu_limit; llama.cpp hard-codes it too

}  // namespace

static void load_gpt_oss_layer(ModelLoader& ld, int il) {
    const HParams& h = ld.hp();
    LayerWeights& L = ld.layer(il);
    ld.attention(il);
    L.attn_sinks = ld.vector(ld.blk(il, "attn_sinks.weight"), h.n_head);
    L.attn_window = il % 2 == 0 ? h.n_swa : 0;
    ld.moe(il, "post_attention_norm.weight");
    L.ffn_gate_inp_b = ld.vector(ld.blk(il, "ffn_gate_inp.bias"), h.n_expert);
    L.ffn_gate_exps_b = ld.stacked_vector(ld.blk(il, "ffn_gate_exps.bias"), h.n_ff_exp, h.n_expert);
    L.ffn_up_exps_b = ld.stacked_vector(ld.blk(il, "ffn_up_exps.bias"), h.n_ff_exp, h.n_expert);
    L.ffn_down_exps_b = ld.stacked_vector(ld.blk(il, "ffn_down_exps.bias"), h.n_embd, h.n_expert);
    L.expert_swiglu_limit = kSwigluLimit;
}

static Act build_gpt_oss_layer(Forward& f, const Act& inp, int il) {
    return f.decoder_layer(inp, il, QkNorm::none);
}

extern const ArchSpec kArchGptOss{"gpt-oss", RopeType::neox, /*expert_weights_norm=*/true, load_gpt_oss_layer,
                                  build_gpt_oss_layer};

}  // namespace sharpi
