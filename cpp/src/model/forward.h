// The shared layer builders every architecture file composes (norm, linear, self-attention,
// MoE FFN, dense FFN, residual add), executed eagerly on the CPU for a batch of tokens.
//
// Activations (Act) are [n_tokens, width] f32 rows in a scratch arena owned by the engine; they
// live until the engine resets the arena after each layer (so a layer must return an Act it
// allocated, and the engine copies it out). Every builder takes a name and the layer index, like
// llama.cpp's callbacks ("ffn_moe_out", il): with dumping enabled each named activation is copied
// to the dump as "<name>-<il>" (or "<name>" for il < 0) for layer-by-layer debugging.
//
// Determinism: every builder computes each token's row with the same code whatever the batch
// size, so prefill and token-by-token decoding give bit-identical results.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cpu/threadpool.h"
#include "model/expert_source.h"
#include "model/model.h"
#include "sharpi/session.h"
#include "trace/timeline.h"

namespace sharpi {

struct Act {
    float* data = nullptr;
    int64_t n_tokens = 0;
    int64_t width = 0;
    float* row(int64_t t) const { return data + t * width; }
};

// Bump allocator for activations. Blocks are kept across resets, so after the first step of a
// given batch size no allocation happens. Pointers stay valid until reset().
class Scratch {
  public:
    float* alloc(int64_t n);
    void reset();

  private:
    struct Block {
        std::unique_ptr<float[]> data;
        int64_t size = 0;
        int64_t used = 0;
    };
    std::vector<Block> blocks_;
};

// f32 K and V for every layer: [n_layer][n_ctx, n_embd_kv]. Pages are touched only when written.
class KvCache {
  public:
    KvCache(int64_t n_layer, int64_t n_ctx, int64_t n_embd_kv);
    float* k(int il) { return k_[static_cast<size_t>(il)].get(); }
    float* v(int il) { return v_[static_cast<size_t>(il)].get(); }
    int64_t n_ctx() const { return n_ctx_; }
    int64_t row_width() const { return n_embd_kv_; }

  private:
    int64_t n_ctx_, n_embd_kv_;
    std::vector<std::unique_ptr<float[]>> k_, v_;
};

// Per-token routing of the last step, kept for stats and tests: [n_tokens, n_expert_used] per layer.
struct Routing {
    std::vector<int32_t> ids;
    std::vector<float> weights;
};

enum class QkNorm { none, per_head, full };

// Recorded expert choices that replace the router's top-k (trace replay): [n_tokens, n_layers, k].
struct RouteTrace {
    int64_t n_tokens = 0, n_layers = 0, k = 0;
    std::vector<int32_t> experts;
    const int32_t* row(int64_t position, int il) const {
        return experts.data() + ((position % n_tokens) * n_layers + il) * k;
    }
};

// Told when a MoE layer's gate has fired during single-token decoding, after the layer's demand
// reads were issued (the prefetcher: its reads then queue behind them). hidden: [n_embd] residual
// entering the MoE block; router_logits: [n_expert]; selected: [top_k] in rank order.
class GateObserver {
  public:
    virtual ~GateObserver() = default;
    virtual void on_gate(int il, const float* hidden, const float* router_logits,
                         const int32_t* selected) = 0;
};

class Forward {
  public:
    Forward(const Model& model, KvCache& kv, cpu::ThreadPool& pool, ExpertSource& experts, Scratch& scratch,
            std::map<std::string, Activation>* dump)
        : model_(model), kv_(kv), pool_(pool), experts_(experts), scratch_(scratch), dump_(dump) {}

    const HParams& hp() const { return model_.hp; }
    const LayerWeights& layer(int il) const { return model_.layers[static_cast<size_t>(il)]; }
    int64_t pos0() const { return pos0_; }
    void set_pos0(int64_t pos0) { pos0_ = pos0; }
    void set_route_trace(const RouteTrace* trace) { route_trace_ = trace; }
    void set_timeline(Timeline* timeline) { timeline_ = timeline; }
    void set_gate_observer(GateObserver* observer) { gate_observer_ = observer; }
    // Exact mode (SessionOptions::exact): every matmul and expert dot in f32 on dequantized
    // weights; otherwise fast mode quantizes activations (cpu/ops/matmul.h).
    void set_exact(bool exact) { exact_ = exact; }
    bool exact() const { return exact_; }
    std::vector<Routing>& routing() { return routing_; }

    Act alloc(int64_t n_tokens, int64_t width);
    // Records `x` under name-il in the dump (when enabled).
    void name(const Act& x, const char* name, int il);

    Act norm(const Act& x, const std::vector<float>& weight, const char* name, int il);
    Act linear(const Act& x, const Linear& w, const char* name, int il);
    Act add(const Act& a, const Act& b, const char* name, int il);

    // Self-attention from the normalised input: q/k/v projections (+ biases), optional q/k RMSNorm
    // (per head with head_dim weights, or over the full projection), RoPE, KV cache append,
    // causal attention, output projection.
    Act self_attention(const Act& cur, int il, QkNorm qk_norm);

    // down(silu(gate x) * up x) with dense weights (dense FFN or a shared expert).
    Act ffn(const Act& cur, const Linear& gate, const Linear& up, const Linear& down, const char* name,
            int il);

    // Routed experts: router softmax, top-k (renormalised when hp().expert_weights_norm), the
    // selected experts through the ExpertSource, weighted sum in top-k rank order; plus the
    // sigmoid-gated shared expert when the layer has one.
    Act moe_ffn(const Act& cur, int il);

    // The pre-norm residual block every supported architecture uses:
    //   h = x + attn(attn_norm(x));  out = h + ffn(ffn_norm(h))
    // where ffn is moe_ffn on layers with routed experts and the dense SwiGLU FFN otherwise.
    Act decoder_layer(const Act& inp, int il, QkNorm qk_norm);

  private:
    void experts_one_token(const Act& cur, const float* router_logits, const int32_t* ids,
                           const float* weights, const std::vector<int32_t>& unique, Act& out, int il);
    void experts_batch(const Act& cur, const int32_t* ids, const float* weights,
                       const std::vector<int32_t>& unique, Act& out, int il);

    const Model& model_;
    KvCache& kv_;
    cpu::ThreadPool& pool_;
    ExpertSource& experts_;
    Scratch& scratch_;
    std::map<std::string, Activation>* dump_;
    void apply_route_trace(const float* probs, int64_t n_tokens, int il, int32_t* ids, float* weights) const;

    int64_t pos0_ = 0;
    const RouteTrace* route_trace_ = nullptr;
    Timeline* timeline_ = nullptr;
    GateObserver* gate_observer_ = nullptr;
    bool exact_ = false;
    const float* moe_hidden_ = nullptr;  // decoder_layer's residual entering the current MoE block
    std::vector<Routing> routing_;
};

}  // namespace sharpi
