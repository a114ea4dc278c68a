// The file's multi-token-prediction block (MTP, "nextn": blk.<n_layer>.*, as llama.cpp's converter
// writes Qwen3.5/3.6-MoE's, Qwen3-Next's and GLM-4.5's), the draft source of speculative decoding.
//
// The block predicts the token after next from the trunk's hidden state h_p of position p
// (after the output norm) and the embedding of the token x_{p+1} that follows it:
//
//   z = eh_proj([enorm(embed(x_{p+1})) | hnorm(h_p)])          (concatenated, 2 * n_embd wide)
//   o = the architecture's decoder layer on z (a full-attention layer, its own KV cache)
//   h' = head_norm(o)    (nextn.shared_head_norm, else output_norm)
//   logits = head(h')    (nextn.shared_head_head, else the trunk's output)
//
// Its attention runs over the pairs (h_p, x_{p+1}) of the sequence so far, pair p at RoPE position
// p + 1 (KV row p, so pair rows start at 0: SeqSpan::rope_shift = 1), as llama.cpp lays them out.
// Drafting k tokens chains the block: h' and the drafted token form the next pair.
//
// DeepSeek-V4 (deepseek4, llama.cpp's graph_mtp there) keeps hc_mult residual streams: h_p is the
// trunk's last layer output, all streams and not normed; hnorm and eh_proj apply per stream, the
// embedding's enorm row is repeated over the streams, the block is the arch's hyper-connected layer,
// its output (all streams) is what the next chained pair takes, and the head collapses it with the
// block file's output_hc_* (a --mtp sidecar's are the block's own) before head_norm and the head.
// Its block must be sliding-window only (compress ratio 0): pair rows then give its attention the
// same relative positions as llama.cpp's (RoPE, with V rotated back, sees only differences), which
// a compressed block's closing windows would not.
//
// Nemotron-H MoE (nemotron_h_moe) folds an attention sub-layer and a MoE sub-layer into its block
// (HParams::attention_then_moe) and norms the head with a LayerNorm.
//
// The block is loaded as the one layer of its own Model over its own mapping of the file (so a
// streamed trunk does not change it): its weights, experts included, stay resident and the
// budget charges them (bytes()).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "model/forward.h"
#include "model/model.h"

namespace sharpi {

class MtpHead {
  public:
    // The first block of `trunk`'s file, or of `sidecar` (a file holding the block of the same
    // model, as llama.cpp's `convert_hf_to_gguf.py --mtp` writes it; InvalidArgument when it
    // describes another model). InvalidArgument when the file has none (nextn_predict_layers = 0),
    // UnsupportedError for an architecture whose block sharpi does not run.
    explicit MtpHead(const Model& trunk, const std::string& sidecar = "");

    // The one-layer model whose layer 0 is the block (for Forward and MoeFfn).
    const Model& model() const { return model_; }
    // Bytes of the block's tensors (dense and experts), all resident.
    uint64_t bytes() const { return bytes_; }
    // The architectures whose block runs here.
    static bool supports(const std::string& arch);
    // The block model's hyper-parameters from its file's: one layer, no leading dense or recurrent
    // layer, and (deepseek32) no sparse attention. Its KV cache is kv_layout of these.
    static HParams block_hparams(const HParams& file_hparams);
    // Bytes of the first nextn block's tensors in `trunk`'s file or `sidecar` (what a head holds).
    static uint64_t file_bytes(const Model& trunk, const std::string& sidecar = "");
    // Per sequence: the block's KV cache for n_ctx positions and the trunk's hidden rows (the block
    // in `trunk`'s file or `sidecar`).
    static uint64_t sequence_bytes(const Model& trunk, const std::string& sidecar, int64_t n_ctx,
                                   GgmlType type_k, GgmlType type_v);
    // Floats per hidden row a pair takes: n_embd (the output-normed row), deepseek4 all hc_mult
    // streams (the raw residual).
    static int64_t hidden_width(const HParams& h) { return h.hc_mult > 1 ? h.n_embd_residual() : h.n_embd; }
    // Whether the trunk's hidden row is its residual after output_norm (else the raw residual).
    static bool hidden_is_normed(const HParams& h) { return h.hc_mult == 1; }

    // Runs the block on n pairs: tokens[i] with hidden row h + i * hidden_width (the trunk's
    // hidden, or a previous block output). `f` has the spans of the pairs (their MTP KV caches,
    // rope_shift 1). Returns the rows [n, hidden_width] the next chained pair takes (a Forward
    // allocation): the head-normed output, deepseek4 the block's streams.
    Act forward(Forward& f, const token_t* tokens, const float* h, int64_t n) const;
    // logits [n_vocab] of row `row` of forward()'s output.
    void head(Forward& f, const Act& out, int64_t row, float* logits) const;

  private:
    static uint64_t block_bytes(const GgufFile& file, int64_t block);

    Model model_;
    std::vector<float> enorm_, hnorm_, head_norm_;
    WeightView eh_proj_, embed_, head_;
    float head_layer_norm_eps_ = 0.0f;  // > 0: the head norm is a LayerNorm (nemotron_h_moe)
    uint64_t bytes_ = 0;
};

}  // namespace sharpi
