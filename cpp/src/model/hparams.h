// Hyper-parameters of a model, read from GGUF metadata only (no per-model constants in code).
// Keys that real files omit are derived from tensor shapes, as llama.cpp does: qwen2moe files carry
// no rope.dimension_count or attention.key_length, Mixtral files no expert_feed_forward_length.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/op_types.h"

namespace sharpi {

class GgufFile;
struct ArchSpec;

struct HParams {
    std::string arch;
    int64_t n_vocab = 0;
    int64_t n_embd = 0;
    int64_t n_layer = 0;
    int64_t n_head = 0;
    int64_t n_head_kv = 0;
    int64_t head_dim = 0;  // per-head width of q and k (attention.key_length, else n_embd / n_head)
    int64_t n_ff = 0;      // dense FFN width (feed_forward_length), 0 if the model has none
    int64_t n_ff_exp = 0;
    int64_t n_ff_shexp = 0;
    // Latent MoE (nemotron_h_moe's Nemotron 3 Super: moe_latent_size): the routed experts read and
    // write vectors of this width, between ffn_latent_down / ffn_latent_up; 0: none (n_embd).
    int64_t n_embd_latent = 0;
    int64_t n_expert = 0;
    int64_t n_expert_used = 0;
    int64_t n_ctx_train = 0;
    float rms_eps = 1e-6f;
    bool expert_weights_norm = false;  // renormalise the top-k router weights to sum 1
    // Gating function, group-limited selection and weight scale (deepseek2); defaults: plain softmax.
    RouterParams router;
    int64_t n_layer_dense_lead = 0;  // leading_dense_block_count: first layers with a dense FFN
    RopeParams rope;
    float attn_scale = 1.0f;  // softmax scale of q.k (1/sqrt(head width), YaRN-adjusted for MLA)
    int64_t n_swa = 0;        // attention.sliding_window (gpt-oss); which layers use it is the arch's

    // Multi-head latent attention (deepseek2; all 0 elsewhere). The converter writes MLA as MQA over
    // the latent: head_count_kv 1, key_length = kv_lora_rank + n_rot, value_length = kv_lora_rank;
    // the per-head q/k and v widths are key_length_mla / value_length_mla.
    int64_t n_lora_q = 0;           // q LoRA rank (attention.q_lora_rank), 0: q is one projection
    int64_t n_lora_kv = 0;          // compressed KV width (attention.kv_lora_rank)
    int64_t n_embd_head_k_mla = 0;  // qk_nope + qk_rope
    int64_t n_embd_head_v_mla = 0;  // v_head_dim
    bool is_mla() const { return n_lora_kv > 0; }

    // A lightning indexer (attention.indexer.*; all 0 without one): indexer_n_head heads of
    // indexer_head_dim score earlier positions with their own keys and attention reads only the
    // indexer_top_k best. DeepSeek Sparse Attention (deepseek32) keeps one key per position beside
    // the MLA latent (model/archs/deepseek32.cpp); deepseek4's CSA layers keep one per compressed
    // entry in their own KV row (model/archs/deepseek4.cpp).
    int64_t indexer_n_head = 0;
    int64_t indexer_head_dim = 0;
    int64_t indexer_top_k = 0;
    // DSA: the indexer over MLA's positions (deepseek4's is part of its compressed attention).
    bool has_indexer() const { return is_mla() && indexer_top_k > 0; }

    // Floats one position takes in one layer's KV cache: the latent (+ RoPE part, + the indexer's
    // key under DSA) for MLA, K and V otherwise.
    int64_t kv_floats_per_token() const {
        return is_mla() ? n_lora_kv + rope.n_rot + indexer_head_dim : 2 * n_embd_kv();
    }

    // Hybrid archs (qwen3next, qwen35moe): Gated DeltaNet layers from the ssm.* keys, named as
    // llama.cpp names them. Zero / empty for every other arch.
    int64_t ssm_d_conv = 0;              // conv1d kernel size
    int64_t ssm_d_state = 0;             // key head width (head_k_dim)
    int64_t ssm_n_group = 0;             // key heads
    int64_t ssm_dt_rank = 0;             // value heads
    int64_t ssm_d_inner = 0;             // value heads * head_v_dim
    std::vector<bool> recurrent_layers;  // [n_layer]: true for a DeltaNet (or Mamba-2) layer
    // nemotron_h_moe: blocks holding only an FFN (no token mixer, so no KV rows); empty elsewhere.
    // The file says which block is which by per-layer arrays: head_count_kv > 0 for attention,
    // feed_forward_length > 0 for an FFN, both 0 for a Mamba-2 block.
    std::vector<bool> ffn_only_layers;
    // Multi-token-prediction blocks after the trunk (blk.n_layer ...); loaded as tensors, not run.
    int64_t n_layer_nextn = 0;

    bool is_recurrent(int il) const {
        return !recurrent_layers.empty() && recurrent_layers[static_cast<size_t>(il)];
    }
    bool is_ffn_only(int il) const {
        return !ffn_only_layers.empty() && ffn_only_layers[static_cast<size_t>(il)];
    }
    // Whether layer il writes KV rows (its token mixer is attention).
    bool has_kv(int il) const { return !is_recurrent(il) && !is_ffn_only(il); }
    // nemotron_h_moe's MTP block (MtpHead::block_hparams): one block holding an attention sub-layer
    // and a MoE sub-layer (llama.cpp's graph_mtp), where every trunk block holds one mixer.
    bool attention_then_moe = false;
    int64_t ssm_head_v_dim() const { return ssm_dt_rank > 0 ? ssm_d_inner / ssm_dt_rank : 0; }
    int64_t ssm_conv_channels() const { return 2 * ssm_n_group * ssm_d_state + ssm_d_inner; }

    // DeepSeek-V4 (deepseek4; model/archs/deepseek4.cpp). hc_mult residual streams of n_embd per
    // token (manifold-constrained hyper-connections; 1 everywhere else), per-layer compression
    // ratios (0 sliding window only, 4 compressed sparse attention, 128 heavily compressed), the
    // compressed branches' RoPE (compress_rope_freq_base), the Lightning Indexer, the grouped output
    // projection, hash-routed leading layers and the clamped SwiGLU limits (0: none).
    int64_t hc_mult = 1;
    int64_t hc_sinkhorn_iters = 0;
    float hc_eps = 0.0f;
    // [n_layer + n_layer_nextn] (the nextn blocks' entries after the trunk's); empty: not deepseek4
    std::vector<int64_t> compress_ratios;
    RopeParams compress_rope;
    int64_t o_groups = 0, o_lora_rank = 0;
    int64_t n_hash_layers = 0;
    std::vector<float> swiglu_clamp_exp, swiglu_clamp_shexp;  // [n_layer + n_layer_nextn]
    // deepseek4's KV row of one position in layer il (f32; model/archs/deepseek4.cpp lays it out):
    // the sliding-window kv [head_dim]; on a compressed layer the compressor's kv and gate+ape rows
    // [coff * head_dim each] and the entry the position's window emits [head_dim]; on a CSA layer
    // the indexer's kv and gate+ape rows [2 * indexer_head_dim each] and its entry [indexer_head_dim].
    int64_t dsv4_kv_row(int il) const {
        const int64_t ratio = compress_ratios[static_cast<size_t>(il)];
        const int64_t coff = ratio == 4 ? 2 : 1;
        int64_t w = head_dim;
        if (ratio > 0) w += 2 * coff * head_dim + head_dim;
        if (ratio == 4) w += 4 * indexer_head_dim + indexer_head_dim;
        return w;
    }
    // Width of a token's residual row: hc_mult streams of n_embd.
    int64_t n_embd_residual() const { return hc_mult * n_embd; }

    int64_t n_embd_q() const { return n_head * head_dim; }
    int64_t n_embd_kv() const { return n_head_kv * head_dim; }
    bool is_moe() const { return n_expert > 0; }
    // Width of a routed expert's input and output.
    int64_t n_embd_exp() const { return n_embd_latent > 0 ? n_embd_latent : n_embd; }
};

// Reads and validates the hyper-parameters of `spec`'s architecture. Throws MissingTensorError for a
// required key that cannot be derived, FormatError for inconsistent values, UnsupportedError for
// an unsupported rope scaling type.
HParams read_hparams(const GgufFile& file, const ArchSpec& spec);

}  // namespace sharpi
