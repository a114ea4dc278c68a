// The shared layer builders every architecture file composes (norm, linear, self-attention,
// MoE FFN, dense FFN, residual add), plus the embedding lookup and the output head, executed
// eagerly for a batch of tokens on a Backend (backend/backend.h): the one forward pass, whatever
// computes it. The engine drives them (embed, one build_layer per layer, output_head); the builders
// call only Backend ops, never a kernel.
//
// Activations (Act) are [n_tokens, width] f32 rows in the backend's memory; they live until the
// engine resets the backend's activations after each layer (so a layer must return an Act it
// allocated, and the engine copies it out). Every builder takes a name and the layer index, like
// llama.cpp's callbacks ("ffn_moe_out", il): with dumping enabled each named activation is copied
// to the dump as "<name>-<il>" (or "<name>" for il < 0) for layer-by-layer debugging.
//
// The MoE FFN's scheduling (routing, expert leases, trace replay, gate events) lives in
// moe/moe_ffn.h; moe_ffn() here is the builder that hands a layer to it.
//
// A step may hold rows of several sequences (continuous batching): its SeqSpans say which rows
// belong to which sequence, at which positions, with which KV cache and recurrent state. Attention,
// RoPE, the KV append and the DeltaNet recurrence run span by span; everything else (norms, every
// matmul, the MoE FFN) runs on the whole step at once.
//
// Determinism: every builder computes each token's row with the same code whatever the batch
// size and whatever other rows (of this or other sequences) share the step, so prefill,
// token-by-token decoding and a sequence batched with others give bit-identical results.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/kv_cache.h"
#include "model/model.h"
#include "sharpi/types.h"
#include "trace/timeline.h"

namespace sharpi {

class MoeFfn;
class RecurrentState;

enum class QkNorm { none, per_head, full };

// One sequence's rows in a step: rows [row0, row0 + n_tokens) of every activation are positions
// pos0 .. pos0 + n_tokens - 1 of the sequence that owns `kv` and `recurrent`. Invariant: a step's
// spans are disjoint, in row order, and cover its rows; one sequence appears at most once.
struct SeqSpan {
    KvCache* kv = nullptr;                // nullptr only where no layer writes a KV row
    RecurrentState* recurrent = nullptr;  // hybrid archs' DeltaNet state; nullptr otherwise
    int64_t pos0 = 0, row0 = 0, n_tokens = 0;
    // Keep the recurrent state after each token (RecurrentState rewind points): the DeltaNet
    // layers then take the span's tokens one at a time, as one-token decodes do, bit for bit.
    bool rewindable = false;
    // RoPE position = KV row + rope_shift: the MTP block's pairs start at position 1 in row 0
    // (model/mtp.h); 0 everywhere else.
    int64_t rope_shift = 0;
};

class Forward {
  public:
    Forward(const Model& model, Backend& backend, MoeFfn& moe, ActivationDump* dump)
        : model_(model), backend_(backend), moe_(moe), dump_(dump) {}

    const HParams& hp() const { return model_.hp; }
    const LayerWeights& layer(int il) const { return model_.layers[static_cast<size_t>(il)]; }
    Backend& backend() { return backend_; }
    // The step's sequences (see SeqSpan). A single-sequence step is one span from row 0.
    void set_spans(std::vector<SeqSpan> spans) { spans_ = std::move(spans); }
    const std::vector<SeqSpan>& spans() const { return spans_; }
    // The position of row `row` in its sequence.
    int64_t position(int64_t row) const;
    void set_timeline(Timeline* timeline) { timeline_ = timeline; }
    bool dumping() const { return dump_ != nullptr; }
    // Exact mode (SessionOptions::exact): every matmul and expert dot in f32 on dequantized
    // weights; otherwise fast mode quantizes activations (backend/backend.h matmul).
    void set_exact(bool exact) { exact_ = exact; }
    // The step's token ids, one per row (deepseek4's hash-routed layers choose experts by token);
    // nullptr where the caller has none (an MTP block).
    void set_tokens(const token_t* tokens) { tokens_ = tokens; }
    const token_t* tokens() const { return tokens_; }
    bool exact() const { return exact_; }

    Act alloc(int64_t n_tokens, int64_t width);
    // Records `x` under name-il in the dump (when enabled).
    void name(const Act& x, const char* name, int il);

    // x.row(t) = the embedding of tokens[t] (dequantized token_embd row), named "inp_embd"; with
    // hyper-connections (deepseek4) every one of the hc_mult streams of x.row(t) holds it.
    void embed(const token_t* tokens, const Act& x);
    // Final RMSNorm and lm_head of rows [first_row, n_tokens) of x: logits [n_tokens - first_row,
    // n_vocab] (named "result_norm", "result_output"). With hyper-connections the hc head first
    // collapses each row's streams (cpu/ops/hyper_connection.h).
    void output_head(const Act& x, int64_t first_row, float* logits);

    Act norm(const Act& x, const std::vector<float>& weight, const char* name, int il);
    Act linear(const Act& x, const Linear& w, const char* name, int il);
    // The same for a matrix and bias the model holds apart (the router's ffn_gate_inp and, gpt-oss,
    // its bias): the bias is read where the model keeps it, so a device backend finds its upload.
    Act linear(const Act& x, const WeightView& w, const std::vector<float>& bias, const char* name, int il);
    Act add(const Act& a, const Act& b, const char* name, int il);

    // Self-attention from the normalised input: q/k/v projections (+ biases), optional q/k RMSNorm
    // (per head with head_dim weights, or over the full projection), RoPE, KV cache append,
    // causal attention, output projection.
    Act self_attention(const Act& cur, int il, QkNorm qk_norm);

    // Gated attention (model/hybrid_layer.cpp): splits attn_q's [query | gate] rows per head into
    // the query (returned) and *gate; output_gate scales the attention output by sigmoid(gate).
    Act split_query_gate(const Act& q_full, Act* gate, int il);
    void output_gate(const Act& kqv, const Act& gate, int il);

    // Gated DeltaNet token mixer from the normalised input (model/hybrid_layer.cpp): qkv and z
    // projections, beta / decay, causal conv1d (rolling state), L2-normalised q/k, the gated delta
    // rule (recurrent for one token, chunked for a batch), gated RMSNorm, output projection.
    Act gated_delta_net(const Act& cur, int il);

    // Mamba-2 token mixer from the normalised input (model/mamba2_layer.cpp): in-projection to
    // z, x B C and dt; causal conv1d + SiLU over x B C (rolling state); the selective scan (D skip
    // included); y * silu(z); grouped RMSNorm; output projection.
    Act mamba2(const Act& cur, int il);

    // down(silu(gate x) * up x) with dense weights (dense FFN or a shared expert); without a gate
    // (nemotron_h_moe's shared expert) down(relu(up x)^2).
    Act ffn(const Act& cur, const Linear& gate, const Linear& up, const Linear& down, const char* name,
            int il);

    // Routed experts (and the shared expert) through MoeFfn: router softmax, top-k (renormalised
    // when hp().expert_weights_norm), the selected experts through the ExpertSource, weighted sum
    // in top-k rank order. hidden: the residual entering the block (for the gate event).
    Act moe_ffn(const Act& cur, const float* hidden, int il);

    // The pre-norm residual block every supported architecture uses:
    //   h = x + attn(attn_norm(x));  out = h + ffn(ffn_norm(h))
    // where ffn is moe_ffn on layers with routed experts and the dense SwiGLU FFN otherwise, and
    // attn is gated_delta_net on a hybrid model's recurrent layers.
    Act decoder_layer(const Act& inp, int il, QkNorm qk_norm);
    // The same block with another attention (deepseek2's MLA): attention(attn_norm(x)) -> [T, n_embd].
    Act decoder_layer(const Act& inp, int il, const std::function<Act(const Act&)>& attention);

  private:
    const Model& model_;
    Backend& backend_;
    MoeFfn& moe_;
    ActivationDump* dump_;

    std::vector<SeqSpan> spans_;
    Timeline* timeline_ = nullptr;
    bool exact_ = false;
    const token_t* tokens_ = nullptr;
};

}  // namespace sharpi
