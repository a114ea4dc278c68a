// deepseek4: DeepSeek-V4 (Flash / Pro). docs/design.md §12 lists what it adds to deepseek2; the
// arithmetic follows transformers' modeling_deepseek_v4.py, the tensors llama.cpp's converter.
//
// A layer: two manifold-constrained hyper-connections (cpu/ops/hyper_connection.h) around an
// attention block and a MoE block; the residual row is hc_mult streams of n_embd.
//
// Attention: shared-KV MQA (one kv row of head_dim that is K and V), q through the q LoRA with an
// unweighted per-head RMSNorm, RoPE on each head's trailing n_rot dims, a per-head sink, the
// output's rope dims rotated back by -position, grouped output projection. Every layer attends to
// the last sliding_window positions (the query's included); compressed layers (ratio 4: CSA,
// 128: HCA) also attend to compressed entries, one per closed window of `ratio` positions, which a
// query at position p sees when w < (p + 1) / ratio. HCA takes all of them; CSA the indexer's
// top_k (higher score first, equal scores: lower entry first).
//
// Per-sequence state lives in the layer's KV row of each position (HParams::dsv4_kv_row, f32):
//   [0, D)                          the sliding-window kv (normed, rotated)
//   ratio > 0:  [D, D + cD)         the compressor's kv row         (cD = coff * D; coff 2 on CSA)
//               [.., + cD)          its gate row + ape[p % ratio]
//               [.., + D)           the entry emitted by the window this position closes
//                                   (valid only where (p + 1) % ratio == 0)
//   ratio == 4: [.., + 2 Di)        the indexer compressor's kv row, then gate + ape [2 Di],
//               [.., + Di)          and its entry
// An entry depends only on rows at or before the position that closes its window, so a step
// computes exactly what a one-token decode of the same positions would: prefill, decode, chunked
// prefill, truncation and batching give the same bits.
//
// CPU only: the builders read and write activations and the cache on the host (the CUDA device
// path refuses the architecture in cuda/device_plan.cpp).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "cpu/cpu_backend.h"
#include "cpu/ops/hyper_connection.h"
#include "cpu/ops/rope.h"
#include "model/arch.h"
#include "model/forward.h"
#include "model/model.h"
#include "sharpi/errors.h"

namespace sharpi {

static void load_deepseek4_layer(ModelLoader& ld, int il) {
    const HParams& h = ld.hp();
    LayerWeights& L = ld.layer(il);
    const int64_t D = h.head_dim, E = h.n_embd, n_hc = h.hc_mult, n_mix = (2 + n_hc) * n_hc;
    L.attn_norm = ld.vector(ld.blk(il, "attn_norm.weight"), E);
    L.attn_sinks = ld.vector(ld.blk(il, "attn_sinks.weight"), h.n_head);
    L.wq_a.w = ld.matrix(ld.blk(il, "attn_q_a.weight"), E, h.n_lora_q);
    L.attn_q_a_norm = ld.vector(ld.blk(il, "attn_q_a_norm.weight"), h.n_lora_q);
    L.wq_b.w = ld.matrix(ld.blk(il, "attn_q_b.weight"), h.n_lora_q, h.n_head * D);
    L.wkv.w = ld.matrix(ld.blk(il, "attn_kv.weight"), E, D);
    L.attn_kv_norm = ld.vector(ld.blk(il, "attn_kv_a_norm.weight"), D);
    L.wo_a.w =
        ld.matrix(ld.blk(il, "attn_output_a.weight"), h.n_head * D / h.o_groups, h.o_groups * h.o_lora_rank);
    L.wo_b.w = ld.matrix(ld.blk(il, "attn_output_b.weight"), h.o_groups * h.o_lora_rank, E);
    L.hc_attn_fn.w = ld.matrix(ld.blk(il, "hc_attn_fn.weight"), n_hc * E, n_mix);
    L.hc_attn_base = ld.vector(ld.blk(il, "hc_attn_base.weight"), n_mix);
    L.hc_attn_scale = ld.vector(ld.blk(il, "hc_attn_scale.weight"), 3);
    L.hc_ffn_fn.w = ld.matrix(ld.blk(il, "hc_ffn_fn.weight"), n_hc * E, n_mix);
    L.hc_ffn_base = ld.vector(ld.blk(il, "hc_ffn_base.weight"), n_mix);
    L.hc_ffn_scale = ld.vector(ld.blk(il, "hc_ffn_scale.weight"), 3);

    const int64_t ratio = h.compress_ratios[static_cast<size_t>(il)];
    L.compress_ratio = ratio;
    if (ratio > 0) {
        const int64_t cD = (ratio == 4 ? 2 : 1) * D;
        L.comp_wkv.w = ld.matrix(ld.blk(il, "attn_compressor_kv.weight"), E, cD);
        L.comp_wgate.w = ld.matrix(ld.blk(il, "attn_compressor_gate.weight"), E, cD);
        L.comp_ape = ld.stacked_vector(ld.blk(il, "attn_compressor_ape.weight"), cD, ratio);
        L.comp_norm = ld.vector(ld.blk(il, "attn_compressor_norm.weight"), D);
    }
    if (ratio == 4) {
        const int64_t Di = h.indexer_head_dim;
        L.idx_proj.w = ld.matrix(ld.blk(il, "indexer.proj.weight"), E, h.indexer_n_head);
        L.idx_q_b.w = ld.matrix(ld.blk(il, "indexer.attn_q_b.weight"), h.n_lora_q, h.indexer_n_head * Di);
        L.idx_comp_wkv.w = ld.matrix(ld.blk(il, "indexer_compressor_kv.weight"), E, 2 * Di);
        L.idx_comp_wgate.w = ld.matrix(ld.blk(il, "indexer_compressor_gate.weight"), E, 2 * Di);
        L.idx_comp_ape = ld.stacked_vector(ld.blk(il, "indexer_compressor_ape.weight"), 2 * Di, ratio);
        L.idx_comp_norm = ld.vector(ld.blk(il, "indexer_compressor_norm.weight"), Di);
    }

    ld.moe(il);
    if (il < h.n_hash_layers) {
        L.tid2eid = ld.int_table(ld.blk(il, "ffn_gate_tid2eid.weight"), h.n_expert_used, h.n_vocab);
        for (int32_t e : L.tid2eid) {
            if (e < 0 || e >= h.n_expert) {
                throw FormatError("[model] " + ld.model().file->path() + ": tensor " +
                                  ld.blk(il, "ffn_gate_tid2eid.weight") + " names expert " +
                                  std::to_string(e) + " outside [0, " + std::to_string(h.n_expert) + ")");
            }
        }
    } else {
        L.exp_probs_b = ld.vector(ld.blk(il, "exp_probs_b.bias"), h.n_expert);
    }
    ld.shared_expert(il);
    L.expert_swiglu_clamp = h.swiglu_clamp_exp[static_cast<size_t>(il)];
    L.shexp_swiglu_clamp = h.swiglu_clamp_shexp[static_cast<size_t>(il)];
}

namespace {

// Where each piece sits in a position's KV row (see the header comment).
struct RowLayout {
    int64_t ratio = 0, coff = 1;
    int64_t comp_kv = 0, comp_gate = 0, comp_entry = 0;
    int64_t idx_kv = 0, idx_gate = 0, idx_entry = 0;
};

RowLayout row_layout(const HParams& h, int il) {
    RowLayout r;
    const int64_t D = h.head_dim, Di = h.indexer_head_dim;
    r.ratio = h.compress_ratios[static_cast<size_t>(il)];
    r.coff = r.ratio == 4 ? 2 : 1;
    int64_t at = D;
    if (r.ratio > 0) {
        r.comp_kv = at;
        r.comp_gate = at += r.coff * D;
        r.comp_entry = at += r.coff * D;
        at += D;
    }
    if (r.ratio == 4) {
        r.idx_kv = at;
        r.idx_gate = at += 2 * Di;
        r.idx_entry = at += 2 * Di;
    }
    return r;
}

const float* cache_row(const KvCache& kv, int il, int64_t pos) {
    return reinterpret_cast<const float*>(kv.k(il) + static_cast<size_t>(pos) * kv.row_bytes_k());
}

// The entry of window w (positions [w * ratio, (w + 1) * ratio), all already in the cache) of one
// compressor whose kv / gate rows start at kv_off / gate_off, width coff * d: per channel, the
// softmax over the window's gates (with, when coff == 2, the previous window's first halves
// before the current window's second halves) weights the kv values; then RMSNorm and RoPE at
// position w * ratio.
void compress_window(const KvCache& kv, int il, int64_t w, int64_t ratio, int64_t coff, int64_t d,
                     int64_t kv_off, int64_t gate_off, const std::vector<float>& norm, float eps,
                     const RopeParams& rope, float* entry) {
    std::vector<const float*> rows;
    std::vector<int64_t> col;  // column offset of the slot's half
    if (coff == 2 && w > 0) {
        for (int64_t i = 0; i < ratio; ++i) {
            rows.push_back(cache_row(kv, il, (w - 1) * ratio + i));
            col.push_back(0);
        }
    }
    for (int64_t i = 0; i < ratio; ++i) {
        rows.push_back(cache_row(kv, il, w * ratio + i));
        col.push_back(coff == 2 ? d : 0);
    }
    const size_t n = rows.size();
    std::vector<float> g(n);
    for (int64_t c = 0; c < d; ++c) {
        float mx = -INFINITY;
        for (size_t s = 0; s < n; ++s) {
            g[s] = rows[s][gate_off + col[s] + c];
            mx = std::max(mx, g[s]);
        }
        float sum = 0.0f;
        for (size_t s = 0; s < n; ++s) {
            g[s] = std::exp(g[s] - mx);
            sum += g[s];
        }
        float acc = 0.0f;
        for (size_t s = 0; s < n; ++s) acc += rows[s][kv_off + col[s] + c] * (g[s] / sum);
        entry[c] = acc;
    }
    double ss = 0.0;
    for (int64_t c = 0; c < d; ++c) ss += static_cast<double>(entry[c]) * entry[c];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(d) + eps));
    for (int64_t c = 0; c < d; ++c) entry[c] = entry[c] * inv * norm[static_cast<size_t>(c)];
    cpu::rope(entry + (d - rope.n_rot), d, 1, 1, d, w * ratio, rope);
}

// Softmax attention of one head's query over `keys` (rows of d, each K and V), with the head's sink.
void attend(const float* q, const std::vector<const float*>& keys, int64_t d, float scale, float sink,
            float* out) {
    std::vector<float> logit(keys.size());
    float mx = sink;
    for (size_t j = 0; j < keys.size(); ++j) {
        float s = 0.0f;
        for (int64_t c = 0; c < d; ++c) s += q[c] * keys[j][c];
        logit[j] = s * scale;
        mx = std::max(mx, logit[j]);
    }
    float sum = std::exp(sink - mx);
    for (float& l : logit) {
        l = std::exp(l - mx);
        sum += l;
    }
    std::fill(out, out + d, 0.0f);
    for (size_t j = 0; j < keys.size(); ++j) {
        const float p = logit[j] / sum;
        for (int64_t c = 0; c < d; ++c) out[c] += p * keys[j][c];
    }
}

Act dsv4_attention(Forward& f, const Act& cur, int il) {
    const HParams& h = f.hp();
    const LayerWeights& L = f.layer(il);
    Backend& b = f.backend();
    const int64_t T = cur.n_tokens, H = h.n_head, D = h.head_dim, n_rot = h.rope.n_rot, nope = D - n_rot;
    const int64_t Hi = h.indexer_n_head, Di = h.indexer_head_dim;
    const RowLayout lay = row_layout(h, il);
    const RopeParams& rope = lay.ratio > 0 ? h.compress_rope : h.rope;

    Act qa = f.linear(cur, L.wq_a, "q_a", il);
    qa = f.norm(qa, L.attn_q_a_norm, "q_a_norm", il);
    Act q = f.linear(qa, L.wq_b, "Qcur", il);
    cpu::rms_norm_unweighted(q.data, q.data, D, T * H, D, h.rms_eps);
    Act kv = f.linear(cur, L.wkv, "kv", il);
    b.rms_norm(kv.data, kv.width, kv.data, kv.width, T, D, L.attn_kv_norm.data(), h.rms_eps);
    Act ckv, cgate, ikv, igate, iq, iw;
    if (lay.ratio > 0) {
        ckv = f.linear(cur, L.comp_wkv, "comp_kv", il);
        cgate = f.linear(cur, L.comp_wgate, "comp_gate", il);
    }
    if (lay.ratio == 4) {
        ikv = f.linear(cur, L.idx_comp_wkv, "indexer_comp_kv", il);
        igate = f.linear(cur, L.idx_comp_wgate, "indexer_comp_gate", il);
        iq = f.linear(qa, L.idx_q_b, "indexer_q", il);
        iw = f.linear(cur, L.idx_proj, "indexer_weights", il);
    }

    Act o = f.alloc(T, H * D);
    std::vector<float> row_full;  // one position's KV row (the cache's width: the widest layer's)
    for (const SeqSpan& s : f.spans()) {
        KvCache& cache = *s.kv;
        row_full.assign(static_cast<size_t>(cache.row_width()), 0.0f);
        cpu::rope(q.row(s.row0) + nope, q.width, s.n_tokens, H, D, s.pos0, rope);
        cpu::rope(kv.row(s.row0) + nope, kv.width, s.n_tokens, 1, D, s.pos0, rope);
        if (lay.ratio == 4)
            cpu::rope(iq.row(s.row0) + (Di - n_rot), iq.width, s.n_tokens, Hi, Di, s.pos0, h.compress_rope);

        // The span's rows, position by position: a window's entry reads rows the span stored first.
        for (int64_t t = 0; t < s.n_tokens; ++t) {
            const int64_t r = s.row0 + t, p = s.pos0 + t;
            std::copy_n(kv.row(r), D, row_full.begin());
            if (lay.ratio > 0) {
                const int64_t cD = lay.coff * D, slot = p % lay.ratio;
                std::copy_n(ckv.row(r), cD, row_full.begin() + lay.comp_kv);
                for (int64_t c = 0; c < cD; ++c)
                    row_full[static_cast<size_t>(lay.comp_gate + c)] =
                        cgate.row(r)[c] + L.comp_ape[static_cast<size_t>(slot * cD + c)];
                std::fill_n(row_full.begin() + lay.comp_entry, D, 0.0f);
            }
            if (lay.ratio == 4) {
                const int64_t slot = p % lay.ratio;
                std::copy_n(ikv.row(r), 2 * Di, row_full.begin() + lay.idx_kv);
                for (int64_t c = 0; c < 2 * Di; ++c)
                    row_full[static_cast<size_t>(lay.idx_gate + c)] =
                        igate.row(r)[c] + L.idx_comp_ape[static_cast<size_t>(slot * 2 * Di + c)];
                std::fill_n(row_full.begin() + lay.idx_entry, Di, 0.0f);
            }
            cache.store_k(il, p, row_full.data());
            if (lay.ratio > 0 && (p + 1) % lay.ratio == 0) {
                const int64_t w = p / lay.ratio;
                compress_window(cache, il, w, lay.ratio, lay.coff, D, lay.comp_kv, lay.comp_gate, L.comp_norm,
                                h.rms_eps, h.compress_rope, row_full.data() + lay.comp_entry);
                if (lay.ratio == 4) {
                    compress_window(cache, il, w, lay.ratio, 2, Di, lay.idx_kv, lay.idx_gate, L.idx_comp_norm,
                                    h.rms_eps, h.compress_rope, row_full.data() + lay.idx_entry);
                }
                cache.store_k(il, p, row_full.data());
            }
        }

        // Attention of each query over its window and its compressed entries: the queries are
        // independent (they read only rows stored above), so they split over the CPU pool; every
        // query computes the same bits whichever thread takes it.
        auto queries = [&](int64_t t0, int64_t t1, int) {
            std::vector<const float*> keys;
            std::vector<float> score;
            std::vector<int64_t> order;
            for (int64_t t = t0; t < t1; ++t) {
                const int64_t r = s.row0 + t, p = s.pos0 + t;
                keys.clear();
                for (int64_t j = std::max<int64_t>(0, p - h.n_swa + 1); j <= p; ++j)
                    keys.push_back(cache_row(cache, il, j));
                if (lay.ratio > 0) {
                    const int64_t n_valid = (p + 1) / lay.ratio;
                    auto entry_row = [&](int64_t w) {
                        return cache_row(cache, il, w * lay.ratio + lay.ratio - 1);
                    };
                    if (lay.ratio == 4 && n_valid > h.indexer_top_k) {
                        // Lightning Indexer: sum_h w_h relu(q_h . k_w) / sqrt(Di), w_h = proj / sqrt(Hi).
                        score.assign(static_cast<size_t>(n_valid), 0.0f);
                        const float qscale = 1.0f / std::sqrt(static_cast<float>(Di));
                        const float wscale = 1.0f / std::sqrt(static_cast<float>(Hi));
                        for (int64_t w = 0; w < n_valid; ++w) {
                            const float* k = entry_row(w) + lay.idx_entry;
                            float sc = 0.0f;
                            for (int64_t hh = 0; hh < Hi; ++hh) {
                                const float* qh = iq.row(r) + hh * Di;
                                float dot = 0.0f;
                                for (int64_t c = 0; c < Di; ++c) dot += qh[c] * k[c];
                                sc += std::max(dot, 0.0f) * qscale * (iw.row(r)[hh] * wscale);
                            }
                            score[static_cast<size_t>(w)] = sc;
                        }
                        order.resize(static_cast<size_t>(n_valid));
                        std::iota(order.begin(), order.end(), 0);
                        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t c) {
                            return score[static_cast<size_t>(a)] > score[static_cast<size_t>(c)];
                        });
                        order.resize(static_cast<size_t>(h.indexer_top_k));
                        std::sort(order.begin(), order.end());
                        for (int64_t w : order) keys.push_back(entry_row(w) + lay.comp_entry);
                    } else {
                        for (int64_t w = 0; w < n_valid; ++w) keys.push_back(entry_row(w) + lay.comp_entry);
                    }
                }
                for (int64_t hh = 0; hh < H; ++hh)
                    attend(q.row(r) + hh * D, keys, D, h.attn_scale, L.attn_sinks[static_cast<size_t>(hh)],
                           o.row(r) + hh * D);
                // V carried RoPE: rotate the output's rope dims back by the query's position.
                cpu::rope(o.row(r) + nope, o.width, 1, H, D, -p, rope);
            }
        };
        if (auto* cpu_backend = dynamic_cast<CpuBackend*>(&b)) {
            // Bytes each query reads: its window and up to top_k (HCA: every) entry, all heads.
            const int64_t per_query =
                (h.n_swa + std::max<int64_t>(h.indexer_top_k, s.pos0 / 128 + 1)) * D * H;
            cpu_backend->pool().parallel_for_bytes(s.n_tokens, s.n_tokens * per_query * 4, queries);
        } else {
            queries(0, s.n_tokens, 0);  // a wrapping backend (the op recorder): the same bits, serially
        }
    }
    f.name(o, "kqv_out", il);

    // Grouped output projection: group g's heads through its o_lora_rank rows of wo_a.
    const int64_t G = h.o_groups, R = h.o_lora_rank, in_g = H * D / G;
    Act y = f.alloc(T, G * R);
    for (int64_t g = 0; g < G; ++g) {
        WeightView w = L.wo_a.w;
        w.data += static_cast<size_t>(g * R) * w.row_bytes;
        w.n_rows = R;
        b.matmul(w, o.data + g * in_g, o.width, T, y.data + g * R, y.width, f.exact());
    }
    f.name(y, "attn_out_a", il);
    return f.linear(y, L.wo_b, "attn_out", il);
}

// One hyper-connection around `block`: the streams of x collapse into the block's input (normed
// by `norm`), and its output spreads back over the mixed streams.
template <typename Block>
Act hyper_block(Forward& f, const Act& x, const Linear& fn, const std::vector<float>& base,
                const std::vector<float>& scale, const std::vector<float>& norm, const char* norm_name,
                int il, Block block) {
    const HParams& h = f.hp();
    const int64_t T = x.n_tokens, n_hc = h.hc_mult, E = h.n_embd;
    Act flat = f.alloc(T, x.width);
    cpu::rms_norm_unweighted(x.data, flat.data, x.width, T, x.width, h.rms_eps);
    Act mixes = f.linear(flat, fn, "hc_mixes", il);
    std::vector<float> pre(static_cast<size_t>(T * n_hc)), post(pre.size()), comb(pre.size() * n_hc);
    cpu::hc_block_weights(mixes.data, T, n_hc, base.data(), scale.data(), h.hc_eps, h.hc_sinkhorn_iters,
                          pre.data(), post.data(), comb.data());
    Act collapsed = f.alloc(T, E);
    cpu::hc_collapse(x.data, T, n_hc, E, pre.data(), collapsed.data);
    Act cur = f.norm(collapsed, norm, norm_name, il);
    Act out = block(cur, collapsed);
    Act y = f.alloc(T, x.width);
    cpu::hc_expand(x.data, out.data, T, n_hc, E, post.data(), comb.data(), y.data);
    return y;
}

}  // namespace

static Act build_deepseek4_layer(Forward& f, const Act& inp, int il) {
    if (!f.backend().host_memory())
        throw UnsupportedError(
            "[model] deepseek4 runs on the CPU backend only (hyper-connections, compressed attention)");
    const LayerWeights& L = f.layer(il);
    Act x = hyper_block(f, inp, L.hc_attn_fn, L.hc_attn_base, L.hc_attn_scale, L.attn_norm, "attn_norm", il,
                        [&](const Act& cur, const Act&) { return dsv4_attention(f, cur, il); });
    f.name(x, "ffn_inp", il);
    Act y =
        hyper_block(f, x, L.hc_ffn_fn, L.hc_ffn_base, L.hc_ffn_scale, L.ffn_norm, "ffn_norm", il,
                    [&](const Act& cur, const Act& collapsed) { return f.moe_ffn(cur, collapsed.data, il); });
    f.name(y, "l_out", il);
    return y;
}

extern const ArchSpec kArchDeepseek4{
    "deepseek4",          RopeType::normal,      /*expert_weights_norm=*/true,
    load_deepseek4_layer, build_deepseek4_layer, Gating::sqrt_softplus};

}  // namespace sharpi
