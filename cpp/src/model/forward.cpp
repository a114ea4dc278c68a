#include "model/forward.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu/ops/activation.h"
#include "cpu/ops/attention.h"
#include "cpu/ops/matmul.h"
#include "cpu/ops/norm.h"
#include "cpu/ops/rope.h"
#include "cpu/ops/router.h"
#include "cpu/quant/kernels.h"

namespace sharpi {

// ---------------------------------------------------------------------------------------------
// Scratch and KV cache

float* Scratch::alloc(int64_t n) {
    n = (n + 15) & ~int64_t{15};  // keep every activation 64-byte aligned within its block
    for (Block& b : blocks_) {
        if (b.size - b.used >= n) {
            float* p = b.data.get() + b.used;
            b.used += n;
            return p;
        }
    }
    Block b;
    b.size = std::max<int64_t>(n, int64_t{1} << 20);
    b.data.reset(new float[static_cast<size_t>(b.size)]);
    b.used = n;
    blocks_.push_back(std::move(b));
    return blocks_.back().data.get();
}

void Scratch::reset() {
    for (Block& b : blocks_) b.used = 0;
}

KvCache::KvCache(int64_t n_layer, int64_t n_ctx, int64_t n_embd_kv) : n_ctx_(n_ctx), n_embd_kv_(n_embd_kv) {
    for (int64_t il = 0; il < n_layer; ++il) {
        // new float[] without () leaves the memory untouched: pages are faulted in as positions fill.
        k_.emplace_back(new float[static_cast<size_t>(n_ctx * n_embd_kv)]);
        v_.emplace_back(new float[static_cast<size_t>(n_ctx * n_embd_kv)]);
    }
}

// ---------------------------------------------------------------------------------------------
// Basic builders

Act Forward::alloc(int64_t n_tokens, int64_t width) {
    return Act{scratch_.alloc(n_tokens * width), n_tokens, width};
}

void Forward::name(const Act& x, const char* name, int il) {
    if (!dump_) return;
    std::string key = il >= 0 ? std::string(name) + "-" + std::to_string(il) : std::string(name);
    Activation& a = (*dump_)[key];
    a.shape = {x.n_tokens, x.width};
    a.data.assign(x.data, x.data + x.n_tokens * x.width);
}

Act Forward::norm(const Act& x, const std::vector<float>& weight, const char* name, int il) {
    Act y = alloc(x.n_tokens, x.width);
    cpu::rms_norm(x.data, x.width, y.data, y.width, x.n_tokens, x.width, weight.data(), hp().rms_eps);
    this->name(y, name, il);
    return y;
}

Act Forward::linear(const Act& x, const Linear& w, const char* name, int il) {
    Act y = alloc(x.n_tokens, w.w.n_rows);
    cpu::matmul(pool_, w.w, x.data, x.width, x.n_tokens, y.data, y.width, exact_);
    if (!w.bias.empty()) {
        for (int64_t t = 0; t < y.n_tokens; ++t) {
            float* r = y.row(t);
            for (int64_t i = 0; i < y.width; ++i) r[i] += w.bias[static_cast<size_t>(i)];
        }
    }
    this->name(y, name, il);
    return y;
}

Act Forward::add(const Act& a, const Act& b, const char* name, int il) {
    Act y = alloc(a.n_tokens, a.width);
    const int64_t n = a.n_tokens * a.width;
    for (int64_t i = 0; i < n; ++i) y.data[i] = a.data[i] + b.data[i];
    this->name(y, name, il);
    return y;
}

// ---------------------------------------------------------------------------------------------
// Attention

Act Forward::self_attention(const Act& cur, int il, QkNorm qk_norm) {
    const HParams& h = hp();
    const LayerWeights& L = layer(il);
    const int64_t T = cur.n_tokens;
    Act q = linear(cur, L.wq, "Qcur", il);
    Act k = linear(cur, L.wk, "Kcur", il);
    Act v = linear(cur, L.wv, "Vcur", il);

    if (qk_norm == QkNorm::per_head) {
        // Rows of head_dim: [T * n_head, head_dim] viewed in place.
        cpu::rms_norm(q.data, h.head_dim, q.data, h.head_dim, T * h.n_head, h.head_dim, L.attn_q_norm.data(),
                      h.rms_eps);
        cpu::rms_norm(k.data, h.head_dim, k.data, h.head_dim, T * h.n_head_kv, h.head_dim,
                      L.attn_k_norm.data(), h.rms_eps);
    } else if (qk_norm == QkNorm::full) {
        cpu::rms_norm(q.data, q.width, q.data, q.width, T, q.width, L.attn_q_norm.data(), h.rms_eps);
        cpu::rms_norm(k.data, k.width, k.data, k.width, T, k.width, L.attn_k_norm.data(), h.rms_eps);
    }
    if (qk_norm != QkNorm::none) {
        name(q, "Qcur_normed", il);
        name(k, "Kcur_normed", il);
    }
    cpu::rope(q.data, q.width, T, h.n_head, h.head_dim, pos0_, h.rope);
    cpu::rope(k.data, k.width, T, h.n_head_kv, h.head_dim, pos0_, h.rope);
    name(q, "Qcur_rope", il);
    name(k, "Kcur_rope", il);

    float* kc = kv_.k(il);
    float* vc = kv_.v(il);
    const int64_t ld_kv = kv_.row_width();
    for (int64_t t = 0; t < T; ++t) {
        std::memcpy(kc + (pos0_ + t) * ld_kv, k.row(t), sizeof(float) * static_cast<size_t>(ld_kv));
        std::memcpy(vc + (pos0_ + t) * ld_kv, v.row(t), sizeof(float) * static_cast<size_t>(ld_kv));
    }
    Act kqv = alloc(T, h.n_embd_q());
    cpu::AttentionShape shape{h.n_head, h.n_head_kv, h.head_dim,
                              1.0f / std::sqrt(static_cast<float>(h.head_dim))};
    cpu::attention(pool_, q.data, q.width, kc, vc, ld_kv, T, pos0_, shape, kqv.data, kqv.width);
    name(kqv, "kqv_out", il);
    return linear(kqv, L.wo, "attn_out", il);
}

// ---------------------------------------------------------------------------------------------
// FFN

Act Forward::ffn(const Act& cur, const Linear& gate, const Linear& up, const Linear& down, const char* name,
                 int il) {
    Act g = linear(cur, gate, "ffn_gate", il);
    Act u = linear(cur, up, "ffn_up", il);
    Act a = alloc(cur.n_tokens, g.width);
    cpu::swiglu(g.data, u.data, a.data, g.n_tokens * g.width);
    return linear(a, down, name, il);
}

namespace {

// out = sum_j weights[j] * ys[j], in slot order j = 0..k-1: the one place expert outputs are
// combined, shared by the one-token and the batch paths so both round identically.
void weighted_sum(float* out, const float* const* ys, const float* weights, int64_t k, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = weights[0] * ys[0][i];
    for (int64_t j = 1; j < k; ++j) {
        for (int64_t i = 0; i < n; ++i) out[i] += weights[j] * ys[j][i];
    }
}

// Releases an ExpertSource layer on every exit path, exceptions included.
struct ExpertLease {
    ExpertSource& source;
    int il;
    ~ExpertLease() { source.release(il); }
};

}  // namespace

// Decode fast path: the selected experts of the token in two parallel passes (gate+up rows of
// every slot, then down rows of every slot) instead of three matmuls per expert. Experts whose bytes
// are ready go first, in one group; each still-loading expert is then computed as soon as its read
// completes, so compute overlaps the remaining IO. Every row is one dot_row whatever the grouping,
// so the result is bit-identical to the all-resident run.
void Forward::experts_one_token(const Act& cur, const float* router_logits, const int32_t* ids,
                                const float* weights, const std::vector<int32_t>& unique, Act& out, int il) {
    const HParams& h = hp();
    const int64_t k = h.n_expert_used, n_ff = h.n_ff_exp, n_embd = h.n_embd;
    std::vector<ExpertView> views(unique.size());
    experts_.acquire(il, unique.data(), static_cast<int>(unique.size()), views.data());
    ExpertLease lease{experts_, il};
    if (gate_observer_ && moe_hidden_) gate_observer_->on_gate(il, moe_hidden_, router_logits, ids);

    std::vector<int> slot_unique(static_cast<size_t>(k));
    for (int64_t j = 0; j < k; ++j) {
        slot_unique[j] =
            static_cast<int>(std::lower_bound(unique.begin(), unique.end(), ids[j]) - unique.begin());
    }
    // Row dots per distinct expert, bound once (types can differ per tensor and layer); in fast mode
    // x is quantized once per activation format here, and each slot's down input after its SwiGLU.
    const float* x = cur.row(0);
    cpu::PreparedRow x_in(x, n_embd, exact_);
    std::vector<cpu::RowDot> gate_dot(unique.size()), up_dot(unique.size()), down_dot(static_cast<size_t>(k));
    for (size_t u = 0; u < unique.size(); ++u) {
        gate_dot[u] = x_in.bind(views[u].gate.type);
        up_dot[u] = x_in.bind(views[u].up.type);
    }
    std::vector<cpu::PreparedRow> down_in(static_cast<size_t>(k));
    Act g = alloc(k, n_ff), up = alloc(k, n_ff), act = alloc(k, n_ff), y = alloc(k, n_embd);
    auto compute_slots = [&](const std::vector<int64_t>& slots) {
        const int64_t n = static_cast<int64_t>(slots.size());
        if (n == 0) return;
        pool_.parallel_for(n * 2 * n_ff, [&](int64_t begin, int64_t end, int) {
            for (int64_t item = begin; item < end; ++item) {
                const int64_t j = slots[item / (2 * n_ff)], r = item % (2 * n_ff);
                const int u = slot_unique[j];
                const ExpertView& v = views[u];
                if (r < n_ff) {
                    g.row(j)[r] = gate_dot[u](v.gate.data + r * v.gate.row_bytes);
                } else {
                    const int64_t ru = r - n_ff;
                    up.row(j)[ru] = up_dot[u](v.up.data + ru * v.up.row_bytes);
                }
            }
        });
        for (int64_t j : slots) {
            cpu::swiglu(g.row(j), up.row(j), act.row(j), n_ff);
            down_in[j].reset(act.row(j), n_ff, exact_);
            down_dot[j] = down_in[j].bind(views[slot_unique[j]].down.type);
        }
        pool_.parallel_for(n * n_embd, [&](int64_t begin, int64_t end, int) {
            for (int64_t item = begin; item < end; ++item) {
                const int64_t j = slots[item / n_embd], r = item % n_embd;
                const int u = slot_unique[j];
                const ExpertView& v = views[u];
                y.row(j)[r] = down_dot[j](v.down.data + r * v.down.row_bytes);
            }
        });
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
    std::vector<const float*> ys(static_cast<size_t>(k));
    for (int64_t j = 0; j < k; ++j) ys[j] = y.row(j);
    weighted_sum(out.row(0), ys.data(), weights, k, n_embd);
}

// Prefill path: each selected expert runs once over the tokens that chose it (gathered rows),
// then every token sums its k expert outputs in rank order. Experts are acquired in waves of at
// most max_acquire() (a prefill batch can select more experts than a small cache holds).
void Forward::experts_batch(const Act& cur, const int32_t* ids, const float* weights,
                            const std::vector<int32_t>& unique, Act& out, int il) {
    const HParams& h = hp();
    const int64_t T = cur.n_tokens, k = h.n_expert_used, n_ff = h.n_ff_exp, n_embd = h.n_embd;
    Act y = alloc(T * k, n_embd);  // y.row(t * k + j): output of token t's slot j
    std::vector<int64_t> members;
    const size_t wave = static_cast<size_t>(std::max(1, experts_.max_acquire()));
    for (size_t w0 = 0; w0 < unique.size(); w0 += wave) {
        const size_t n_wave = std::min(wave, unique.size() - w0);
        std::vector<ExpertView> views(n_wave);
        experts_.acquire(il, unique.data() + w0, static_cast<int>(n_wave), views.data());
        ExpertLease lease{experts_, il};
        for (size_t u = 0; u < n_wave; ++u) {
            members.clear();
            for (int64_t i = 0; i < T * k; ++i) {
                if (ids[i] == unique[w0 + u]) members.push_back(i);
            }
            const int64_t n = static_cast<int64_t>(members.size());
            Act xe = alloc(n, n_embd), g = alloc(n, n_ff), upv = alloc(n, n_ff), ye = alloc(n, n_embd);
            for (int64_t m = 0; m < n; ++m)
                std::memcpy(xe.row(m), cur.row(members[m] / k), sizeof(float) * n_embd);
            experts_.wait(static_cast<int>(u));
            cpu::matmul(pool_, views[u].gate, xe.data, n_embd, n, g.data, n_ff, exact_);
            cpu::matmul(pool_, views[u].up, xe.data, n_embd, n, upv.data, n_ff, exact_);
            cpu::swiglu(g.data, upv.data, g.data, n * n_ff);
            cpu::matmul(pool_, views[u].down, g.data, n_ff, n, ye.data, n_embd, exact_);
            for (int64_t m = 0; m < n; ++m) std::memcpy(y.row(members[m]), ye.row(m), sizeof(float) * n_embd);
        }
    }
    std::vector<const float*> ys(static_cast<size_t>(k));
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t j = 0; j < k; ++j) ys[j] = y.row(t * k + j);
        weighted_sum(out.row(t), ys.data(), weights + t * k, k, n_embd);
    }
}

// Replaces each token's top-k with the trace's row for its position: the recorded ids as a set
// (duplicates and -1 entries filled with the router's best remaining experts), ordered like the
// router orders (probability descending, then id), weighted by the router's own probabilities.
void Forward::apply_route_trace(const float* probs, int64_t n_tokens, int il, int32_t* ids,
                                float* weights) const {
    const HParams& h = hp();
    const int64_t k = h.n_expert_used, E = h.n_expert;
    std::vector<int32_t> chosen;
    for (int64_t t = 0; t < n_tokens; ++t) {
        const float* p = probs + t * E;
        const int32_t* rec = route_trace_->row(pos0_ + t, il);
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
        float sum = 0.0f;
        for (int64_t j = 0; j < k; ++j) sum += p[chosen[j]];
        for (int64_t j = 0; j < k; ++j) {
            ids[t * k + j] = chosen[j];
            weights[t * k + j] = h.expert_weights_norm ? p[chosen[j]] / sum : p[chosen[j]];
        }
    }
}

Act Forward::moe_ffn(const Act& cur, int il) {
    const HParams& h = hp();
    const LayerWeights& L = layer(il);
    const int64_t T = cur.n_tokens, k = h.n_expert_used;

    Linear router;
    router.w = L.ffn_gate_inp;
    Act logits = linear(cur, router, "ffn_moe_logits", il);
    Act probs = alloc(T, h.n_expert);
    Routing& r = routing_[static_cast<size_t>(il)];
    r.ids.resize(static_cast<size_t>(T * k));
    r.weights.resize(static_cast<size_t>(T * k));
    cpu::route_topk(logits.data, T, h.n_expert, k, h.expert_weights_norm, probs.data, r.ids.data(),
                    r.weights.data());
    if (route_trace_) apply_route_trace(probs.data, T, il, r.ids.data(), r.weights.data());
    name(probs, "ffn_moe_probs", il);
    if (dump_) {
        name(Act{r.weights.data(), T, k}, "ffn_moe_weights", il);
        std::vector<float> topk(r.ids.begin(), r.ids.end());  // expert ids as floats, [T, k]
        name(Act{topk.data(), T, k}, "ffn_moe_topk", il);
    }

    std::vector<int32_t> unique(r.ids.begin(), r.ids.end());
    std::sort(unique.begin(), unique.end());
    unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
    experts_.gate_fired(il, unique.data(), static_cast<int>(unique.size()));
    Act out = alloc(T, h.n_embd);
    if (T == 1) {
        experts_one_token(cur, logits.data, r.ids.data(), r.weights.data(), unique, out, il);
    } else {
        experts_batch(cur, r.ids.data(), r.weights.data(), unique, out, il);
    }
    name(out, "ffn_moe_out", il);

    if (!L.ffn_gate.present()) return out;
    // Shared expert (qwen2moe): always on, scaled by sigmoid(ffn_gate_inp_shexp . x).
    Act shared = ffn(cur, L.ffn_gate, L.ffn_up, L.ffn_down, "ffn_shexp", il);
    if (L.ffn_gate_inp_shexp.data) {
        Linear gate;
        gate.w = L.ffn_gate_inp_shexp;
        Act s = linear(cur, gate, "ffn_shexp_gate", il);
        for (int64_t t = 0; t < T; ++t) {
            const float w = cpu::sigmoid(s.row(t)[0]);
            float* row = shared.row(t);
            for (int64_t i = 0; i < h.n_embd; ++i) row[i] *= w;
        }
    }
    return add(out, shared, "ffn_out", il);
}

// ---------------------------------------------------------------------------------------------
// Block

Act Forward::decoder_layer(const Act& inp, int il, QkNorm qk_norm) {
    const LayerWeights& L = layer(il);
    const bool timed = timeline_ && timeline_->enabled();
    const double t0 = timed ? timeline_->now_us() : 0.0;
    Act cur = norm(inp, L.attn_norm, "attn_norm", il);
    cur = self_attention(cur, il, qk_norm);
    if (timed) timeline_->span("compute", "attention " + std::to_string(il), t0, timeline_->now_us());
    Act ffn_inp = add(cur, inp, "ffn_inp", il);
    cur = norm(ffn_inp, L.ffn_norm, "ffn_norm", il);
    moe_hidden_ = ffn_inp.data;
    cur =
        L.experts.gate_tensor ? moe_ffn(cur, il) : ffn(cur, L.ffn_gate, L.ffn_up, L.ffn_down, "ffn_out", il);
    return add(cur, ffn_inp, "l_out", il);
}

}  // namespace sharpi
