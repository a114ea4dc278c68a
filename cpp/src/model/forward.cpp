#include "model/forward.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "moe/moe_ffn.h"
#include "sharpi/errors.h"

namespace sharpi {

// ---------------------------------------------------------------------------------------------
// Basic builders

int64_t Forward::position(int64_t row) const {
    for (const SeqSpan& s : spans_) {
        if (row >= s.row0 && row < s.row0 + s.n_tokens) return s.pos0 + (row - s.row0);
    }
    throw InvalidArgument("[forward] row " + std::to_string(row) + " belongs to no sequence of the step");
}

Act Forward::alloc(int64_t n_tokens, int64_t width) {
    return backend_.alloc(n_tokens, width);
}

void Forward::name(const Act& x, const char* name, int il) {
    if (!dump_) return;
    std::string key = il >= 0 ? std::string(name) + "-" + std::to_string(il) : std::string(name);
    Activation& a = (*dump_)[key];
    a.shape = {x.n_tokens, x.width};
    a.data.resize(static_cast<size_t>(x.n_tokens * x.width));
    backend_.read(x, a.data.data());
}

Act Forward::norm(const Act& x, const std::vector<float>& weight, const char* name, int il) {
    Act y = alloc(x.n_tokens, x.width);
    backend_.rms_norm(x.data, x.width, y.data, y.width, x.n_tokens, x.width, weight.data(), hp().rms_eps);
    this->name(y, name, il);
    return y;
}

Act Forward::linear(const Act& x, const Linear& w, const char* name, int il) {
    return linear(x, w.w, w.bias, name, il);
}

Act Forward::linear(const Act& x, const WeightView& w, const std::vector<float>& bias, const char* name,
                    int il) {
    Act y = alloc(x.n_tokens, w.n_rows);
    backend_.matmul(w, x.data, x.width, x.n_tokens, y.data, y.width, exact_);
    if (!bias.empty()) backend_.add_bias(y, bias.data());
    this->name(y, name, il);
    return y;
}

Act Forward::add(const Act& a, const Act& b, const char* name, int il) {
    Act y = alloc(a.n_tokens, a.width);
    backend_.add(a, b, y);
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
    Act gate;
    if (L.attn_output_gate) q = split_query_gate(q, &gate, il);
    Act k = linear(cur, L.wk, "Kcur", il);
    Act v = linear(cur, L.wv, "Vcur", il);

    if (qk_norm == QkNorm::per_head) {
        // Rows of head_dim: [T * n_head, head_dim] viewed in place.
        backend_.rms_norm(q.data, h.head_dim, q.data, h.head_dim, T * h.n_head, h.head_dim,
                          L.attn_q_norm.data(), h.rms_eps);
        backend_.rms_norm(k.data, h.head_dim, k.data, h.head_dim, T * h.n_head_kv, h.head_dim,
                          L.attn_k_norm.data(), h.rms_eps);
    } else if (qk_norm == QkNorm::full) {
        backend_.rms_norm(q.data, q.width, q.data, q.width, T, q.width, L.attn_q_norm.data(), h.rms_eps);
        backend_.rms_norm(k.data, k.width, k.data, k.width, T, k.width, L.attn_k_norm.data(), h.rms_eps);
    }
    if (qk_norm != QkNorm::none) {
        name(q, "Qcur_normed", il);
        name(k, "Kcur_normed", il);
    }
    Act kqv = alloc(T, h.n_embd_q());
    AttentionShape shape{h.n_head, h.n_head_kv, h.head_dim, 1.0f / std::sqrt(static_cast<float>(h.head_dim))};
    shape.window = L.attn_window;
    shape.exact = exact_;
    if (!L.attn_sinks.empty()) shape.sinks = L.attn_sinks.data();
    // RoPE, the KV append and attention per sequence: each span's rows at its own positions against
    // its own cache (the rows are laid out identically whatever else shares the step).
    for (const SeqSpan& s : spans_) {
        const int64_t rope_pos0 = s.pos0 + s.rope_shift;
        if (L.attn_rope) {  // false: NoPE (nemotron_h_moe's attention)
            backend_.rope(q.row(s.row0), q.width, s.n_tokens, h.n_head, h.head_dim, rope_pos0, h.rope);
            backend_.rope(k.row(s.row0), k.width, s.n_tokens, h.n_head_kv, h.head_dim, rope_pos0, h.rope);
        }
        const Act k_rows{k.row(s.row0), s.n_tokens, k.width}, v_rows{v.row(s.row0), s.n_tokens, v.width};
        backend_.kv_store(*s.kv, il, s.pos0, k_rows, &v_rows);
        backend_.attention(q.row(s.row0), q.width, *s.kv, il, s.n_tokens, s.pos0, shape, kqv.row(s.row0),
                           kqv.width);
    }
    name(q, "Qcur_rope", il);
    name(k, "Kcur_rope", il);
    name(kqv, "kqv_out", il);
    if (L.attn_output_gate) output_gate(kqv, gate, il);
    return linear(kqv, L.wo, "attn_out", il);
}

// ---------------------------------------------------------------------------------------------
// FFN

Act Forward::ffn(const Act& cur, const Linear& gate, const Linear& up, const Linear& down, const char* name,
                 int il) {
    Act u = linear(cur, up, "ffn_up", il);
    Act a = alloc(cur.n_tokens, u.width);
    if (gate.present()) {
        Act g = linear(cur, gate, "ffn_gate", il);
        backend_.swiglu(g.data, u.data, a.data, g.n_tokens * g.width);
    } else {
        backend_.relu_sqr(u.data, a.data, u.n_tokens * u.width);
    }
    return linear(a, down, name, il);
}

Act Forward::moe_ffn(const Act& cur, const float* hidden, int il) {
    return moe_.forward(*this, cur, hidden, il);
}

// ---------------------------------------------------------------------------------------------
// Embedding and output head

void Forward::embed(const token_t* tokens, const Act& x) {
    const HParams& h = hp();
    if (h.hc_mult == 1) {
        backend_.get_rows(model_.token_embd, tokens, x);
        name(x, "inp_embd", -1);
        return;
    }
    Act e = alloc(x.n_tokens, h.n_embd);
    backend_.get_rows(model_.token_embd, tokens, e);
    name(e, "inp_embd", -1);
    for (int64_t j = 0; j < h.hc_mult; ++j)
        backend_.copy_rows(e.data, e.width, x.data + j * h.n_embd, x.width, x.n_tokens, h.n_embd);
}

void Forward::output_head(const Act& x, int64_t first_row, float* logits) {
    const HParams& h = hp();
    const int64_t n_out = x.n_tokens - first_row;
    if (n_out <= 0) return;
    const float* rows = x.row(first_row);
    if (h.hc_mult > 1) {
        // The hc head: the streams collapse into one row before the final norm.
        const int64_t n_hc = h.hc_mult, width = h.n_embd_residual();
        Act flat = alloc(n_out, width);
        backend_.rms_norm_unweighted(rows, flat.data, width, n_out, width, h.rms_eps);
        Act mixes = linear(flat, model_.hc_head_fn, "hc_head_mixes", -1);
        Act pre = alloc(n_out, n_hc);
        backend_.hc_head_weights(mixes.data, n_out, n_hc, model_.hc_head_base.data(),
                                 model_.hc_head_scale.data(), h.hc_eps, pre.data);
        Act collapsed = alloc(n_out, h.n_embd);
        backend_.hc_collapse(rows, n_out, n_hc, h.n_embd, pre.data, collapsed.data);
        name(collapsed, "hc_head_out", -1);
        rows = collapsed.data;
    }
    Act normed = alloc(n_out, h.n_embd);
    backend_.rms_norm(rows, h.n_embd, normed.data, h.n_embd, n_out, h.n_embd, model_.output_norm.data(),
                      h.rms_eps);
    name(normed, "result_norm", -1);
    // On a host-memory backend the head writes straight into `logits`; elsewhere it computes on the
    // backend and the rows come back once.
    if (backend_.host_memory()) {
        backend_.matmul(model_.output, normed.data, h.n_embd, n_out, logits, h.n_vocab, exact_);
        name(Act{logits, n_out, h.n_vocab}, "result_output", -1);
        return;
    }
    Act out = alloc(n_out, h.n_vocab);
    backend_.matmul(model_.output, normed.data, h.n_embd, n_out, out.data, out.width, exact_);
    name(out, "result_output", -1);
    backend_.read(out, logits);
}

// ---------------------------------------------------------------------------------------------
// Block

Act Forward::decoder_layer(const Act& inp, int il, QkNorm qk_norm) {
    // Hybrid archs (qwen3next, qwen35moe): Gated DeltaNet on the recurrent layers.
    return decoder_layer(inp, il, [&](const Act& cur) {
        return hp().is_recurrent(il) ? gated_delta_net(cur, il) : self_attention(cur, il, qk_norm);
    });
}

Act Forward::decoder_layer(const Act& inp, int il, const std::function<Act(const Act&)>& attention) {
    const LayerWeights& L = layer(il);
    const bool timed = timeline_ && timeline_->enabled();
    const double t0 = timed ? timeline_->now_us() : 0.0;
    Act cur = norm(inp, L.attn_norm, "attn_norm", il);
    cur = attention(cur);
    if (timed) timeline_->span("compute", "attention " + std::to_string(il), t0, timeline_->now_us());
    Act ffn_inp = add(cur, inp, "ffn_inp", il);
    cur = norm(ffn_inp, L.ffn_norm, "ffn_norm", il);
    cur = model_.experts.layers[static_cast<size_t>(il)].present()
              ? moe_ffn(cur, ffn_inp.data, il)
              : ffn(cur, L.ffn_gate, L.ffn_up, L.ffn_down, "ffn_out", il);
    return add(cur, ffn_inp, "l_out", il);
}

}  // namespace sharpi
