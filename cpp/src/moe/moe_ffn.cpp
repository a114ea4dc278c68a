#include "moe/moe_ffn.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <string>

#include "sharpi/errors.h"

namespace sharpi {

namespace {

// Expert `e` of layer L as the compute ops take it: its leased bytes, and (gpt-oss) its slices of
// the layer's resident biases and the clamped SwiGLU. Invariant: the biases never travel with the
// expert's bytes; they are dense, resident f32 (LayerWeights), so every ExpertSource, budget and
// predictor serves the same expert bytes as before and streamed == resident holds unchanged.
ExpertFfnWeights expert_weights(const ExpertView& v, const LayerWeights& L, int64_t e, int64_t n_ff,
                                int64_t n_embd) {
    ExpertFfnWeights w{v.gate, v.up, v.down};
    if (!L.ffn_gate_exps_b.empty()) w.gate_b = L.ffn_gate_exps_b.data() + e * n_ff;
    if (!L.ffn_up_exps_b.empty()) w.up_b = L.ffn_up_exps_b.data() + e * n_ff;
    if (!L.ffn_down_exps_b.empty()) w.down_b = L.ffn_down_exps_b.data() + e * n_embd;
    w.swiglu_limit = L.expert_swiglu_limit;
    w.swiglu_clamp = L.expert_swiglu_clamp;
    w.relu_sqr = L.expert_relu_sqr;
    return w;
}

// Releases an ExpertSource layer on every exit path, exceptions included.
struct ExpertLease {
    ExpertSource& source;
    int il;
    ~ExpertLease() { source.release(il); }
};

}  // namespace

// Decode fast path: when every selected expert is ready, the backend's fused expert_ffn_one_token
// (SwiGLU and the router-weighted sum fused in). Otherwise the selected experts in two parallel
// passes per group (gate+up rows, then down rows): experts whose bytes are ready go first, in one group; each
// still-loading expert is then computed as soon as its read completes, so compute overlaps the remaining IO.
// Every row is one RowDot whatever the grouping, so the result is bit-identical to the all-resident run.
void MoeFfn::experts_one_token(Forward& f, const Act& cur, const float* hidden, const float* router_logits,
                               const int32_t* ids, const float* weights, const std::vector<int32_t>& unique,
                               Act& out, int il, const std::function<void()>& overlap) {
    const HParams& h = f.hp();
    const LayerWeights& L = f.layer(il);
    const int64_t k = h.n_expert_used, n_ff = h.n_ff_exp, n_embd = h.n_embd_exp();
    std::vector<ExpertView> views(unique.size());
    experts_.acquire(il, unique.data(), static_cast<int>(unique.size()), views.data());
    ExpertLease lease{experts_, il};
    // The layer's demand reads are out: the observer's prefetches queue behind them, and the
    // overlapped work (the shared expert) computes while they are read.
    if (gate_observer_ && hidden) gate_observer_->on_gate(il, 1, hidden, router_logits, ids);
    overlap();

    std::vector<int> slot_unique(static_cast<size_t>(k));
    bool all_ready = true;
    for (int64_t j = 0; j < k; ++j) {
        slot_unique[j] =
            static_cast<int>(std::lower_bound(unique.begin(), unique.end(), ids[j]) - unique.begin());
        all_ready = all_ready && experts_.ready(slot_unique[j]);
    }
    std::vector<ExpertFfnWeights> w(static_cast<size_t>(k));
    for (int64_t j = 0; j < k; ++j) w[j] = expert_weights(views[slot_unique[j]], L, ids[j], n_ff, n_embd);
    Backend& b = f.backend();
    if (all_ready) {
        // Nothing to overlap: the fused op (same bits as the slot-by-slot passes below).
        b.expert_ffn_one_token(w.data(), weights, static_cast<int>(k), cur.row(0), out.row(0), f.exact());
        return;
    }
    // Slot by slot: the ready experts' slots in one call, then each still-loading expert's slots as
    // soon as its read completes. Every row is one row dot whatever the grouping.
    Act y = f.alloc(k, n_embd);
    auto compute_slots = [&](const std::vector<int64_t>& slots) {
        if (slots.empty()) return;
        std::vector<ExpertFfnWeights> ws;
        for (int64_t j : slots) ws.push_back(w[j]);
        b.expert_ffn_slots(ws.data(), slots.data(), static_cast<int64_t>(slots.size()), cur.row(0), y,
                           f.exact());
    };
    std::vector<int64_t> ready_slots;
    for (int64_t j = 0; j < k; ++j) {
        if (experts_.ready(slot_unique[j])) ready_slots.push_back(j);
    }
    compute_slots(ready_slots);
    for (size_t u = 0; u < unique.size(); ++u) {
        std::vector<int64_t> slots;
        for (int64_t j = 0; j < k; ++j) {
            if (slot_unique[j] == static_cast<int>(u) &&
                std::find(ready_slots.begin(), ready_slots.end(), j) == ready_slots.end()) {
                slots.push_back(j);
            }
        }
        if (slots.empty()) continue;
        experts_.wait(static_cast<int>(u));
        compute_slots(slots);
    }
    std::vector<int64_t> rows(static_cast<size_t>(k));
    for (int64_t j = 0; j < k; ++j) rows[j] = j;
    b.moe_combine(y, rows.data(), weights, k, out);
}

// Prefill path: each selected expert runs once over the tokens that chose it (the backend's expert_ffn_batch
// on the slots grouped by expert), then every token sums its k expert outputs in rank order.
// Experts are acquired in waves of at most max_acquire() (a prefill batch can select more experts
// than a small cache holds); within a wave the ready experts run together, then each one still
// being read as soon as it arrives (the op gives every row the same bits whatever the grouping).
void MoeFfn::experts_batch(Forward& f, const Act& cur, const Act& in, bool per_slot, const float* hidden,
                           const float* router_logits, const int32_t* ids, const float* weights,
                           const std::vector<int32_t>& unique, Act& out, int il,
                           const std::function<void()>& overlap) {
    const HParams& h = f.hp();
    const int64_t T = cur.n_tokens, k = h.n_expert_used, n_embd = h.n_embd_exp();
    const int64_t n_slots = T * k;
    // Slots i = t * k + j grouped by expert (counting sort, stable): members [begin[u], end[u]) of
    // unique[u] are rows of y; tokens[m] is member m's token, member_of[i] slot i's member.
    const size_t n_unique = unique.size();
    std::vector<int64_t> begin(n_unique + 1, 0), end(n_unique), tokens(static_cast<size_t>(n_slots)),
        member_of(static_cast<size_t>(n_slots));
    std::vector<int> slot_unique(static_cast<size_t>(n_slots));
    for (int64_t i = 0; i < n_slots; ++i) {
        slot_unique[i] =
            static_cast<int>(std::lower_bound(unique.begin(), unique.end(), ids[i]) - unique.begin());
        ++begin[slot_unique[i] + 1];
    }
    for (size_t u = 0; u < n_unique; ++u) begin[u + 1] += begin[u];
    for (size_t u = 0; u < n_unique; ++u) end[u] = begin[u];
    for (int64_t i = 0; i < n_slots; ++i) {
        const int64_t m = end[slot_unique[i]]++;
        tokens[m] = per_slot ? i : i / k;
        member_of[i] = m;
    }
    Act y = f.alloc(n_slots, n_embd);  // y.row(member_of[t * k + j]): output of token t's slot j
    Backend& b = f.backend();
    const size_t wave = static_cast<size_t>(std::max(1, experts_.max_acquire()));
    // The next MoE layer's guessed experts, read while this layer computes (only when the whole
    // layer is one wave: with several, read-ahead would evict what the later waves find cached).
    std::vector<int32_t> ahead;
    if (read_ahead_ && n_unique <= wave && il + 1 < static_cast<int>(routing_.size()) &&
        f.layer(il + 1).ffn_gate_inp.data != nullptr) {
        ahead = guess_next_layer(f, cur, il + 1);
    }
    for (size_t w0 = 0; w0 < n_unique; w0 += wave) {
        if (w0 > 0 && cancel_ && cancel_->load(std::memory_order_relaxed)) {
            throw CancelledError("decode cancelled in layer " + std::to_string(il) + " after " +
                                 std::to_string(w0) + " of " + std::to_string(n_unique) + " experts");
        }
        const size_t n_wave = std::min(wave, n_unique - w0);
        std::vector<ExpertView> views(n_wave);
        experts_.acquire(il, unique.data() + w0, static_cast<int>(n_wave), views.data());
        ExpertLease lease{experts_, il};
        if (!ahead.empty()) experts_.read_ahead(il + 1, ahead.data(), static_cast<int>(ahead.size()));
        if (w0 == 0) {
            // The first wave's reads (and the read-ahead) are out: the observer's prefetches for
            // later layers queue behind them.
            if (gate_observer_ && hidden) gate_observer_->on_gate(il, T, hidden, router_logits, ids);
            overlap();
        }
        std::vector<ExpertFfnWeights> w;
        std::vector<int64_t> group_begin, group_end;
        auto run = [&] {
            if (w.empty()) return;
            b.expert_ffn_batch(w.data(), group_begin.data(), group_end.data(), static_cast<int>(w.size()),
                               tokens.data(), in.data, n_embd, y.data, n_embd, f.exact());
            w.clear();
            group_begin.clear();
            group_end.clear();
        };
        auto add = [&](size_t u) {
            w.push_back(expert_weights(views[u], f.layer(il), unique[w0 + u], h.n_ff_exp, n_embd));
            group_begin.push_back(begin[w0 + u]);
            group_end.push_back(end[w0 + u]);
        };
        std::vector<bool> done(n_wave, false);
        for (size_t u = 0; u < n_wave; ++u) {
            if (experts_.ready(static_cast<int>(u))) {
                add(u);
                done[u] = true;
            }
        }
        run();
        for (size_t u = 0; u < n_wave; ++u) {
            if (done[u]) continue;
            experts_.wait(static_cast<int>(u));
            add(u);
            run();
        }
    }
    b.moe_combine(y, member_of.data(), weights, k, out);
}

std::vector<int32_t> MoeFfn::guess_next_layer(Forward& f, const Act& cur, int il_next) const {
    const HParams& h = f.hp();
    const int64_t T = cur.n_tokens, k = h.n_expert_used;
    const LayerWeights& L = f.layer(il_next);
    Act logits = f.linear(cur, L.ffn_gate_inp, L.ffn_gate_inp_b, "ffn_moe_ahead_logits", il_next);
    Act probs = f.alloc(T, h.n_expert);
    std::vector<int32_t> ids(static_cast<size_t>(T * k));
    std::vector<float> weights(static_cast<size_t>(T * k));
    RouterParams router_params = h.router;
    if (!L.exp_probs_b.empty()) router_params.selection_bias = L.exp_probs_b.data();
    f.backend().route_topk(logits, k, router_params, probs, ids.data(), weights.data());
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    return ids;
}

// Replaces each token's top-k with the trace's row for its position: the recorded ids as a set
// (duplicates and -1 entries filled with the router's best remaining experts), ordered like the
// router orders (probability descending, then id), weighted by the router's own probabilities.
void MoeFfn::apply_route_trace(Forward& f, const float* probs, int64_t n_tokens, int il, int32_t* ids,
                               float* weights) const {
    const HParams& h = f.hp();
    Backend& b = f.backend();
    const int64_t k = h.n_expert_used, E = h.n_expert;
    std::vector<int32_t> chosen;
    for (int64_t t = 0; t < n_tokens; ++t) {
        const float* p = probs + t * E;
        const int32_t* rec = route_trace_->row(f.position(t), il);
        chosen.clear();
        for (int64_t j = 0; j < k; ++j) {
            if (rec[j] >= 0 && std::find(chosen.begin(), chosen.end(), rec[j]) == chosen.end())
                chosen.push_back(rec[j]);
        }
        // Fill gaps with the router's own choices (ids[] holds its top-k in rank order; any
        // further need is met by scanning all experts by probability).
        for (int64_t j = 0; j < k && static_cast<int64_t>(chosen.size()) < k; ++j) {
            const int32_t e = ids[t * k + j];
            if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
        }
        for (int32_t e = 0; e < E && static_cast<int64_t>(chosen.size()) < k; ++e) {
            if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
        }
        std::sort(chosen.begin(), chosen.end(),
                  [&](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
        std::copy(chosen.begin(), chosen.begin() + k, ids + t * k);
        b.topk_weights(p, ids + t * k, k, h.router, weights + t * k);
    }
}

Act MoeFfn::forward(Forward& f, const Act& cur, const float* hidden, int il) {
    const HParams& h = f.hp();
    const LayerWeights& L = f.layer(il);
    const int64_t T = cur.n_tokens, k = h.n_expert_used;

    Act logits = f.linear(cur, L.ffn_gate_inp, L.ffn_gate_inp_b, "ffn_moe_logits", il);  // bias: gpt-oss
    Act probs = f.alloc(T, h.n_expert);
    Routing& r = routing_[static_cast<size_t>(il)];
    r.ids.resize(static_cast<size_t>(T * k));
    r.weights.resize(static_cast<size_t>(T * k));
    RouterParams router_params = h.router;
    if (!L.exp_probs_b.empty()) router_params.selection_bias = L.exp_probs_b.data();
    f.backend().route_topk(logits, k, router_params, probs, r.ids.data(), r.weights.data());
    if (!L.tid2eid.empty()) {
        // deepseek4's hash layers: the experts are the token's row of the frozen table (in its
        // order), weighted by their gating scores as the router weights a top-k.
        const token_t* tokens = f.tokens();
        if (!tokens)
            throw InvalidArgument("[moe] layer " + std::to_string(il) +
                                  " routes by token id, but the step has none");
        for (int64_t t = 0; t < T; ++t) {
            std::copy_n(L.tid2eid.data() + static_cast<size_t>(tokens[t]) * k, k, r.ids.data() + t * k);
            f.backend().topk_weights(probs.row(t), r.ids.data() + t * k, k, h.router,
                                     r.weights.data() + t * k);
        }
    }
    if (route_trace_) {
        // The replay ranks by the router's probabilities on the host.
        std::vector<float> host_probs(static_cast<size_t>(T * h.n_expert));
        f.backend().read(probs, host_probs.data());
        apply_route_trace(f, host_probs.data(), T, il, r.ids.data(), r.weights.data());
    }
    f.name(probs, "ffn_moe_probs", il);
    if (f.dumping()) {
        f.name(Act{r.weights.data(), T, k}, "ffn_moe_weights", il);
        std::vector<float> topk(r.ids.begin(), r.ids.end());  // expert ids as floats, [T, k]
        f.name(Act{topk.data(), T, k}, "ffn_moe_topk", il);
    }

    std::vector<int32_t> unique(r.ids.begin(), r.ids.end());
    std::sort(unique.begin(), unique.end());
    unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
    experts_.gate_fired(il, unique.data(), static_cast<int>(unique.size()));
    // The shared expert needs no streamed bytes: the expert paths run it once the routed experts'
    // reads are out and before they wait for any, so it computes while those reads are in flight.
    // It is computed from `cur` alone and added last, so the bits do not depend on when it runs.
    Act shared;
    const auto shared_expert = [&] {
        if (L.ffn_up.present()) shared = shared_ffn(f, cur, il);
    };
    // llama4: the router weight scales each slot's input row; the outputs then sum with weight 1
    // (an exact 1.0f * y, so every path still rounds alike).
    Act in = cur;
    if (L.ffn_latent_down.present()) in = f.linear(cur, L.ffn_latent_down, "ffn_latent_down", il);
    const float* combine_weights = r.weights.data();
    std::vector<float> ones;
    if (L.expert_input_weighted) {
        Backend& b = f.backend();
        in = f.alloc(T * k, h.n_embd);
        for (int64_t j = 0; j < k; ++j)
            b.copy_rows(cur.data, cur.width, in.row(j), k * in.width, T, h.n_embd);
        b.scale_rows(in, r.weights.data());
        ones.assign(static_cast<size_t>(T * k), 1.0f);
        combine_weights = ones.data();
    }
    Act out = f.alloc(T, h.n_embd_exp());
    // One token reads one input row unless its k slots each have their own (weighted, k > 1).
    if (T == 1 && in.n_tokens == 1) {
        experts_one_token(f, in, hidden, logits.data, r.ids.data(), combine_weights, unique, out, il,
                          shared_expert);
    } else {
        experts_batch(f, cur, in, L.expert_input_weighted, hidden, logits.data, r.ids.data(), combine_weights,
                      unique, out, il, shared_expert);
    }
    f.name(out, "ffn_moe_out", il);
    if (L.ffn_latent_up.present()) out = f.linear(out, L.ffn_latent_up, "ffn_latent_up", il);
    if (!L.ffn_up.present()) return out;
    if (!shared.data) shared_expert();  // no expert was acquired (cannot happen with n_tokens > 0)
    return f.add(out, shared, "ffn_out", il);
}

// Shared expert: always on; scaled by sigmoid(ffn_gate_inp_shexp . x) where the layer has that gate
// (qwen2moe), added as it is otherwise (deepseek2).
Act MoeFfn::shared_ffn(Forward& f, const Act& cur, int il) {
    const LayerWeights& L = f.layer(il);
    if (L.shexp_swiglu_clamp > 0.0f) {
        // deepseek4: the shared expert's SwiGLU is clamped like its routed experts'.
        Act g = f.linear(cur, L.ffn_gate, "ffn_shexp_gate_proj", il);
        Act u = f.linear(cur, L.ffn_up, "ffn_shexp_up", il);
        Act a = f.alloc(cur.n_tokens, g.width);
        f.backend().swiglu_clamped(g.data, u.data, a.data, g.n_tokens * g.width, L.shexp_swiglu_clamp);
        return f.linear(a, L.ffn_down, "ffn_shexp", il);
    }
    Act shared = f.ffn(cur, L.ffn_gate, L.ffn_up, L.ffn_down, "ffn_shexp", il);
    if (L.ffn_gate_inp_shexp.data) {
        Linear gate;
        gate.w = L.ffn_gate_inp_shexp;
        Act s = f.linear(cur, gate, "ffn_shexp_gate", il);
        f.backend().scale_rows_sigmoid(shared, s);
    }
    return shared;
}

}  // namespace sharpi
