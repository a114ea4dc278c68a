// MoeFfn: the routed-expert FFN of a MoE layer and its scheduling against the ExpertSource
// (docs/design.md §3): router softmax and top-k (or a recorded route trace), the gate event, the
// experts leased from the source (acquire / wait / release, in waves for prefill batches), the
// weighted sum in top-k rank order, and the shared expert where the layer has one.
//
// Owns the last step's per-layer routing. Called on the decode thread by the layer builders
// (Forward::moe_ffn) for one batch of tokens; the engine makes one per chunk and tells it where
// gate events go (GateObserver: the engine, which hands them to the prefetcher). It computes with
// the Forward's Backend ops only and never talks to a reader or a predictor directly.
//
// Determinism: every token's row is computed with the same code whatever the batch size or the
// order in which expert bytes arrive (experts_one_token's ready-first grouping changes only when a
// row is computed, never how), so streamed, prefilled and resident runs are bit-identical.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <vector>

#include "model/forward.h"
#include "moe/expert_source.h"

namespace sharpi {

// Per-token routing of the last step, kept for stats and tests: [n_tokens, n_expert_used] per layer.
struct Routing {
    std::vector<int32_t> ids;
    std::vector<float> weights;
};

// Recorded expert choices that replace the router's top-k (trace replay): [n_tokens, n_layers, k]
// over the model's MoE layers only, in layer order; layer il reads trace layer moe_index[il] (its
// rank among the MoE layers: il - n_layer_dense_lead in deepseek2, il / 2 in Llama-4 Maverick,
// whose dense and MoE layers alternate). moe_index[il] is -1 for a dense layer.
struct RouteTrace {
    int64_t n_tokens = 0, n_layers = 0, k = 0;
    std::vector<int32_t> moe_index;  // [n_layer], set by Engine::set_route_trace
    std::vector<int32_t> experts;
    const int32_t* row(int64_t position, int il) const {
        return experts.data() + ((position % n_tokens) * n_layers + moe_index[static_cast<size_t>(il)]) * k;
    }
};

// Told when a MoE layer's gate has fired for the rows the engine observes (single-token decoding,
// and steps of a few rows), after the layer's first demand reads were issued (so reads it starts
// queue behind them). Row t of the step: hidden [n_embd] at hidden + t * n_embd (the residual
// entering the MoE block), router_logits [n_expert] at router_logits + t * n_expert, selected
// [top_k] at selected + t * top_k in rank order.
class GateObserver {
  public:
    virtual ~GateObserver() = default;
    virtual void on_gate(int il, int64_t n_rows, const float* hidden, const float* router_logits,
                         const int32_t* selected) = 0;
};

class MoeFfn {
  public:
    MoeFfn(ExpertSource& experts, int64_t n_layer)
        : experts_(experts), routing_(static_cast<size_t>(n_layer)) {}

    void set_route_trace(const RouteTrace* trace) { route_trace_ = trace; }
    void set_gate_observer(GateObserver* observer) { gate_observer_ = observer; }
    // Session::cancel()'s flag, polled between the expert waves of a batch (CancelledError when set).
    void set_cancel_flag(const std::atomic<bool>* flag) { cancel_ = flag; }
    // Prefill batches (n_tokens > 1): while a layer's experts compute, read ahead the experts the
    // next MoE layer's router picks for this batch's hidden state (ExpertSource::read_ahead). The
    // engine turns it on for the last chunk of a prompt only, so that no chunk's reads evict
    // experts that a later chunk of the same layer still needs.
    void set_read_ahead(bool on) { read_ahead_ = on; }
    std::vector<Routing>& routing() { return routing_; }

    // The layer's MoE FFN output for `cur` ([n_tokens, n_embd], normalised): routed experts plus
    // the shared expert (sigmoid-gated where it has a gate) when the layer has one. Where the
    // layer's expert_input_weighted (llama4), slot j of token t runs its expert on
    // weights[t, j] * cur[t] and the outputs are summed unweighted. hidden: the residual entering the
    // block, [n_tokens, n_embd] (its rows go to the gate observer when one is set; nullptr: no gate
    // event).
    Act forward(Forward& f, const Act& cur, const float* hidden, int il);

  private:
    // Decode (one token) and prefill (a batch) paths over the selected experts.
    // `overlap` is called once, after the first acquire (its reads are out) and before any wait.
    // experts_batch's `in` holds the experts' input rows: `cur` itself (slot t * k + j reads row t),
    // or with per_slot one row per slot (slot i reads row i); cur is the layer's normalised input
    // (for the next layer's read-ahead guess).
    void experts_one_token(Forward& f, const Act& cur, const float* hidden, const float* router_logits,
                           const int32_t* ids, const float* weights, const std::vector<int32_t>& unique,
                           Act& out, int il, const std::function<void()>& overlap);
    void experts_batch(Forward& f, const Act& cur, const Act& in, bool per_slot, const float* hidden,
                       const float* router_logits, const int32_t* ids, const float* weights,
                       const std::vector<int32_t>& unique, Act& out, int il,
                       const std::function<void()>& overlap);
    // The shared expert's output for `cur` (the layer must have one).
    static Act shared_ffn(Forward& f, const Act& cur, int il);
    // The unique experts that layer il_next's router picks (top-k per token) for `cur`, the
    // normalised input of the current layer: its guess of what il_next will select.
    std::vector<int32_t> guess_next_layer(Forward& f, const Act& cur, int il_next) const;
    // Row t's trace row is the one of its position in its sequence (Forward::position).
    void apply_route_trace(Forward& f, const float* probs, int64_t n_tokens, int il, int32_t* ids,
                           float* weights) const;

    ExpertSource& experts_;
    const RouteTrace* route_trace_ = nullptr;
    GateObserver* gate_observer_ = nullptr;
    const std::atomic<bool>* cancel_ = nullptr;
    bool read_ahead_ = false;
    std::vector<Routing> routing_;
};

}  // namespace sharpi
