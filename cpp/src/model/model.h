// A loaded model: hyper-parameters plus views of every weight tensor in the GGUF mapping.
//
// Dense weights are views into the read-only mapping (zero copies); small 1-D tensors (norms,
// biases) are copied to f32 so the ops never care how the file stored them. Routed experts are
// described here (stacked tensor views) but compute reaches them only through an ExpertSource
// (moe/expert_source.h), so streaming can replace residency without touching architecture code.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/op_types.h"
#include "gguf/gguf_file.h"
#include "model/arch.h"
#include "model/hparams.h"
#include "moe/expert_layout.h"

namespace sharpi {

// y = W x (+ bias). W: [n_out rows, n_in cols].
struct Linear {
    WeightView w;
    std::vector<float> bias;  // empty: no bias
    bool present() const { return w.data != nullptr; }
};

struct LayerWeights {
    std::vector<float> attn_norm;
    Linear wq, wk, wv, wo;
    std::vector<float> attn_q_norm, attn_k_norm;  // empty when the arch has none
    // Multi-head latent attention (deepseek2): q = wq (or wq_b(norm(wq_a x))), latent and shared
    // RoPE key = wkv_a_mqa x; wk_b / wv_b are per-head matrices stacked head-major:
    // wk_b [n_head * kv_lora_rank, qk_nope] (absorbs k into q), wv_b [n_head * v_head_dim, kv_lora_rank].
    Linear wq_a, wq_b, wkv_a_mqa;
    std::vector<float> attn_q_a_norm, attn_kv_a_norm;
    WeightView wk_b, wv_b;
    // DeepSeek Sparse Attention's lightning indexer (deepseek32): queries indexer_attn_q_b applied to
    // the normed q LoRA [n_lora_q -> n_head_idx * head_size_idx], the key LayerNorm(indexer_attn_k x)
    // with weight and bias [head_size_idx], per-head weights indexer_proj x [n_head_idx].
    Linear indexer_attn_q_b, indexer_attn_k, indexer_proj;
    std::vector<float> indexer_k_norm, indexer_k_norm_b;
    std::vector<float> exp_probs_b;  // [n_expert] selection bias (DeepSeek-V3 noaux_tc); empty: none
    std::vector<float> ffn_norm;
    // dense FFN (dense archs), or the shared expert (qwen2moe)
    Linear ffn_gate, ffn_up, ffn_down;
    WeightView ffn_gate_inp_shexp;  // [1, n_embd] shared-expert gate; data == nullptr: none
    // routed experts
    WeightView ffn_gate_inp;     // router [n_expert, n_embd]
    WeightView ffn_pregate_inp;  // [n_expert, n_embd]: layer il+1's pre-gate; data == nullptr: none
    // Gated attention (qwen3next, qwen35moe): attn_q yields [query | gate] per head, and the
    // attention output is scaled by sigmoid(gate) before attn_output.
    bool attn_output_gate = false;
    // Gated DeltaNet token mixer (model/hybrid_layer.h) on recurrent layers; empty elsewhere.
    // Either ssm_ba (qwen3next: per key head [beta x r, alpha x r]) or ssm_beta + ssm_alpha.
    // ssm_in: older qwen3next files' single projection, per key head [q, k, v x r, z x r].
    Linear ssm_qkv, ssm_gate, ssm_in, ssm_ba, ssm_beta, ssm_alpha, ssm_out;
    std::vector<float> ssm_conv1d;                    // [conv_channels, d_conv]
    std::vector<float> ssm_a, ssm_dt_bias, ssm_norm;  // [n_v_heads] (-exp(A_log)), [n_v_heads], [head_v_dim]
    bool ssm_v_heads_tiled = false;                   // GdnShape::v_heads_tiled
    // Mamba-2 token mixer (nemotron_h_moe, model/mamba2_layer.h) on recurrent layers: ssm_in gives
    // [z | x B C | dt], ssm_conv1d (above) convolves x B C with this bias [conv_channels]; ssm_a
    // (above) is -exp(A_log) and ssm_d the skip [n_head]; ssm_norm is the grouped gated RMSNorm's
    // weight [d_inner].
    std::vector<float> ssm_conv1d_b, ssm_d;
    // gpt-oss: attention sinks [n_head] (AttentionShape::sinks; empty: none), this layer's
    // sliding window (0: full attention), the router's bias [n_expert], the routed experts' biases
    // (gate / up [n_expert * n_ff_exp], down [n_expert * n_embd], expert-major; resident, see
    // MoeFfn's expert_weights) and the clamped SwiGLU's limit (0: plain SwiGLU).
    std::vector<float> attn_sinks;
    int64_t attn_window = 0;
    std::vector<float> ffn_gate_inp_b, ffn_gate_exps_b, ffn_up_exps_b, ffn_down_exps_b;
    float expert_swiglu_limit = 0.0f;
    // nemotron_h_moe: the routed experts and the shared expert have no gate and compute
    // down(relu(up x)^2) (ExpertFfnWeights::relu_sqr; a shared expert without ffn_gate).
    bool expert_relu_sqr = false;
    // Latent MoE (HParams::n_embd_latent): the routed experts run on ffn_latent_down x and their
    // weighted sum goes back through ffn_latent_up; the router and shared expert see x itself.
    Linear ffn_latent_down, ffn_latent_up;
    // llama4 (model/archs/llama4.cpp): whether the layer rotates q/k (false on its NoPE layers),
    // its attention chunk (AttentionShape::chunk; 0: global), the query temperature of its NoPE
    // layers (scale(p) = ln(floor((p + 1) / attn_temp_floor_scale) + 1) * attn_temp_scale + 1;
    // floor_scale 0: none), the RoPE frequency factors (rope_freqs, [n_rot / 2]; empty: none), and
    // whether the router weight multiplies each routed expert's input instead of its output.
    bool attn_rope = true;
    int64_t attn_chunk = 0;
    int64_t attn_temp_floor_scale = 0;
    float attn_temp_scale = 0.0f;
    std::vector<float> rope_freqs;
    bool expert_input_weighted = false;
    // deepseek4 (model/archs/deepseek4.cpp): the shared-KV projection and its norm, the grouped
    // output projection (wo_a: o_groups blocks of o_lora_rank rows, wo_b mixes them), the two
    // hyper-connections' mixes ([(2 + hc) * hc, hc * n_embd], base, 3 scales), the compressor
    // (kv and gate [coff * head_dim, n_embd], ape [ratio, coff * head_dim], norm [head_dim]) and
    // the Lightning Indexer's (its compressor at indexer_head_dim, its query projection from the q
    // latent, its head weights), and the hash layers' token -> experts table [n_vocab, k].
    Linear wkv, wo_a, wo_b, hc_attn_fn, hc_ffn_fn;
    std::vector<float> attn_kv_norm, hc_attn_base, hc_attn_scale, hc_ffn_base, hc_ffn_scale;
    int64_t compress_ratio = 0;
    Linear comp_wkv, comp_wgate, idx_comp_wkv, idx_comp_wgate, idx_q_b, idx_proj;
    std::vector<float> comp_ape, comp_norm, idx_comp_ape, idx_comp_norm;
    std::vector<int32_t> tid2eid;
    float shexp_swiglu_clamp = 0.0f;   // the shared expert's clamped SwiGLU limit (0: plain)
    float expert_swiglu_clamp = 0.0f;  // the routed experts' (ExpertFfnWeights::swiglu_clamp)
    // The routed experts themselves are in Model::experts (an ExpertLayout), not here.
};

struct Model {
    std::unique_ptr<GgufFile> file;
    // Streaming mode: the file is not mapped; dense tensors live here (read once at load), and
    // expert views carry data == nullptr (the expert cache reads them by file offset).
    std::unique_ptr<uint8_t[]> dense_storage;
    std::map<const GgufTensor*, const uint8_t*> dense_data;
    bool streaming = false;
    const ArchSpec* spec = nullptr;
    HParams hp;
    WeightView token_embd;  // [n_vocab, n_embd]
    std::vector<float> output_norm;
    WeightView output;  // [n_vocab, n_embd]; token_embd when the file ties them
    std::vector<LayerWeights> layers;
    // deepseek4: the hyper-connection head that collapses the hc_mult streams before output_norm
    // (fn [hc, hc * n_embd], base [hc], scale [1]); empty elsewhere.
    Linear hc_head_fn;
    std::vector<float> hc_head_base, hc_head_scale;
    // Routed experts of every layer: file ranges and views, built by load_model. The expert cache
    // and the resident source see only this (never Model or GGUF objects).
    ExpertLayout experts;
    uint64_t bytes_dense = 0;
    uint64_t bytes_experts = 0;
};

// Opens `path`, finds its architecture and loads every tensor it needs, checking names, shapes and
// types. Throws FormatError / MissingTensorError / UnsupportedError / IoError with the file and
// tensor named. streaming = false maps the whole file (every expert resident); streaming = true
// reads the dense tensors into memory and leaves the routed experts on disk for an expert cache.
std::unique_ptr<Model> load_model(const std::string& path, bool streaming = false);

// True for the stacked routed-expert tensors (ffn_{gate,up,down}_exps).
bool is_expert_tensor(const std::string& name);
// True for a tensor of block n_layer or later: a nextn (multi-token-prediction) block, which is
// loaded with the file but never run, read or charged.
bool is_nextn_tensor(const std::string& name, int64_t n_layer);

// A stacked routed-expert tensor of n_expert experts in file number `file` as an ExpertPart (its
// view left empty): name, offset of expert 0 and bytes per expert (nbytes / n_expert).
ExpertPart expert_part(const GgufTensor& t, uint32_t file, int64_t n_expert);
// Expert `expert`'s bytes of a stacked tensor (file = the tensor's shard), through expert_part (the
// engine's own slicing). Throws InvalidArgument for a tensor that is not 3-D or an index out of range.
FileRange expert_range(const GgufTensor& t, int64_t expert);

// The shared tensor loaders that architecture files call from their load_layer.
class ModelLoader {
  public:
    // block_offset: the file block that layer 0 is (a multi-token-prediction block loaded as the
    // one layer of its own Model, model/mtp.h); 0 for a trunk.
    explicit ModelLoader(Model& model, int block_offset = 0) : model_(model), block_offset_(block_offset) {}

    Model& model() { return model_; }
    const HParams& hp() const { return model_.hp; }
    LayerWeights& layer(int il) { return model_.layers[static_cast<size_t>(il)]; }

    // A matrix with ggml shape [n_cols, n_rows] (a row = n_cols elements). Throws when absent.
    WeightView matrix(const std::string& name, int64_t n_cols, int64_t n_rows);
    // Same, but returns an empty view when the tensor is absent.
    WeightView optional_matrix(const std::string& name, int64_t n_cols, int64_t n_rows);
    // A 1-D tensor of n elements ([n] or [n, 1]) as f32. Throws when absent.
    std::vector<float> vector(const std::string& name, int64_t n);
    std::vector<float> optional_vector(const std::string& name, int64_t n);
    // n_stack vectors of n elements in one tensor of ggml shape [n, n_stack], as f32 (stack-major).
    std::vector<float> stacked_vector(const std::string& name, int64_t n, int64_t n_stack);
    // An i32 tensor of ggml shape [n, n_stack] (deepseek4's hash routing table), stack-major.
    std::vector<int32_t> int_table(const std::string& name, int64_t n, int64_t n_stack);
    // n_stack matrices of [n_rows, n_cols] in one tensor of ggml shape [n_cols, n_rows, n_stack],
    // viewed as one [n_stack * n_rows, n_cols] matrix.
    WeightView stacked_matrix(const std::string& name, int64_t n_cols, int64_t n_rows, int64_t n_stack);

    // Shared layer pieces (tensor names as llama.cpp's converter writes them):
    // attn_norm, attn_q/k/v/output (+ biases when present).
    void attention(int il);
    // attn_q_norm / attn_k_norm of width `width` (head_dim per head, or the full projection).
    void qk_norm(int il, int64_t q_width, int64_t k_width);
    // The FFN norm (`norm`, ffn_norm in most archs), router ffn_gate_inp and ffn_{gate,up,down}_exps.
    // gated = false (nemotron_h_moe): the file has no ffn_gate_exps; the gate part is laid out as
    // the up tensor again (see ExpertFfnWeights::relu_sqr).
    void moe(int il, const char* norm = "ffn_norm.weight", bool gated = true);
    // The FFN norm (`norm`, ffn_norm in most archs) and dense ffn_{gate,up,down}.
    void dense_ffn(int il, const char* norm = "ffn_norm.weight");
    // qwen2moe's shared expert: ffn_{gate,up,down}_shexp and its gate ffn_gate_inp_shexp.
    // gated = false (nemotron_h_moe): only ffn_{up,down}_shexp.
    void shared_expert(int il, bool gated = true);

    // The file name of file block `block`'s tensor `name` ("blk.N.name").
    static std::string block_name(int block, const char* name) {
        return "blk." + std::to_string(block) + "." + name;
    }
    // The file name of this loader's layer il's tensor `name` (block il + block_offset).
    std::string blk(int il, const char* name) const { return block_name(il + block_offset_, name); }

  private:
    const GgufTensor& require(const std::string& name);
    WeightView view(const GgufTensor& t, int64_t n_cols, int64_t n_rows, int64_t n_stack = 1);
    std::string where(const std::string& tensor) const;

    Model& model_;
    int block_offset_ = 0;
};

}  // namespace sharpi
