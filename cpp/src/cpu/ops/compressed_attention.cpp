#include "cpu/ops/compressed_attention.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "cpu/ops/rope.h"

namespace sharpi::cpu {
namespace {

// Where each piece sits in a position's KV row (see the header comment).
struct RowLayout {
    int64_t ratio = 0, coff = 1;
    int64_t comp_kv = 0, comp_gate = 0, comp_entry = 0;
    int64_t idx_kv = 0, idx_gate = 0, idx_entry = 0;
    int64_t width = 0;
};

RowLayout row_layout(const CompressedAttentionShape& s) {
    RowLayout r;
    const int64_t D = s.head_dim, Di = s.indexer_head_dim;
    r.ratio = s.ratio;
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
        at += Di;
    }
    r.width = at;
    return r;
}

// One compressor: where its kv / gate rows and its entry sit, its width and weights.
struct Compressor {
    int64_t kv_off, gate_off, coff, d;
    const float* norm;
};

// The entry of window w (positions [w * ratio, (w + 1) * ratio), all already stored) of compressor
// c: per channel, the softmax over the window's gates (with, when coff == 2, the previous window's
// first halves before the current window's second halves) weights the kv values; then RMSNorm and
// RoPE at position w * ratio.
void compress_window(const F32Rows& rows, int64_t w, int64_t ratio, const Compressor& c, float eps,
                     const RopeParams& entry_rope, float* entry) {
    std::vector<const float*> src;
    std::vector<int64_t> col;  // column offset of the slot's half
    if (c.coff == 2 && w > 0) {
        for (int64_t i = 0; i < ratio; ++i) {
            src.push_back(rows.data + ((w - 1) * ratio + i) * rows.stride);
            col.push_back(0);
        }
    }
    for (int64_t i = 0; i < ratio; ++i) {
        src.push_back(rows.data + (w * ratio + i) * rows.stride);
        col.push_back(c.coff == 2 ? c.d : 0);
    }
    const size_t n = src.size();
    std::vector<float> g(n);
    for (int64_t ch = 0; ch < c.d; ++ch) {
        float mx = -INFINITY;
        for (size_t s = 0; s < n; ++s) {
            g[s] = src[s][c.gate_off + col[s] + ch];
            mx = std::max(mx, g[s]);
        }
        float sum = 0.0f;
        for (size_t s = 0; s < n; ++s) {
            g[s] = std::exp(g[s] - mx);
            sum += g[s];
        }
        float acc = 0.0f;
        for (size_t s = 0; s < n; ++s) acc += src[s][c.kv_off + col[s] + ch] * (g[s] / sum);
        entry[ch] = acc;
    }
    double ss = 0.0;
    for (int64_t ch = 0; ch < c.d; ++ch) ss += static_cast<double>(entry[ch]) * entry[ch];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(c.d) + eps));
    for (int64_t ch = 0; ch < c.d; ++ch) entry[ch] = entry[ch] * inv * c.norm[ch];
    rope(entry + (c.d - entry_rope.n_rot), c.d, 1, 1, c.d, w * ratio, entry_rope);
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

// Writes the KV row of position p (token t of the step) and, when p closes a window, its entries.
void store_row(const CompressedAttentionInputs& in, const F32Rows& rows, const RowLayout& lay, int64_t t,
               int64_t p, const CompressedAttentionShape& s) {
    const int64_t D = s.head_dim, Di = s.indexer_head_dim;
    float* row = rows.data + p * rows.stride;
    std::fill(row, row + rows.stride, 0.0f);
    std::copy_n(in.kv + t * in.ldkv, D, row);
    if (lay.ratio > 0) {
        const int64_t cD = lay.coff * D, slot = p % lay.ratio;
        std::copy_n(in.comp_kv + t * in.ld_comp, cD, row + lay.comp_kv);
        for (int64_t c = 0; c < cD; ++c)
            row[lay.comp_gate + c] = in.comp_gate[t * in.ld_comp + c] + in.comp_ape[slot * cD + c];
    }
    if (lay.ratio == 4) {
        const int64_t slot = p % lay.ratio;
        std::copy_n(in.idx_kv + t * in.ld_idx, 2 * Di, row + lay.idx_kv);
        for (int64_t c = 0; c < 2 * Di; ++c)
            row[lay.idx_gate + c] = in.idx_gate[t * in.ld_idx + c] + in.idx_ape[slot * 2 * Di + c];
    }
    if (lay.ratio > 0 && (p + 1) % lay.ratio == 0) {
        const int64_t w = p / lay.ratio;
        compress_window(rows, w, lay.ratio, Compressor{lay.comp_kv, lay.comp_gate, lay.coff, D, in.comp_norm},
                        s.eps, s.compress_rope, row + lay.comp_entry);
        if (lay.ratio == 4) {
            compress_window(rows, w, lay.ratio, Compressor{lay.idx_kv, lay.idx_gate, 2, Di, in.idx_norm},
                            s.eps, s.compress_rope, row + lay.idx_entry);
        }
    }
}

}  // namespace

void compressed_attention(ThreadPool& pool, const CompressedAttentionInputs& in, const F32Rows& rows,
                          int64_t n_tokens, int64_t pos0, const CompressedAttentionShape& s, float* out,
                          int64_t ldo) {
    const RowLayout lay = row_layout(s);
    const int64_t H = s.n_head, D = s.head_dim, Hi = s.indexer_n_head, Di = s.indexer_head_dim;
    const int64_t nope = D - s.rope.n_rot;
    // Position by position: a window's entry reads rows the step stored first.
    for (int64_t t = 0; t < n_tokens; ++t) store_row(in, rows, lay, t, pos0 + t, s);

    auto row_at = [&](int64_t pos) -> const float* { return rows.data + pos * rows.stride; };
    auto queries = [&](int64_t t0, int64_t t1, int) {
        std::vector<const float*> keys;
        std::vector<float> score;
        std::vector<int64_t> order;
        for (int64_t t = t0; t < t1; ++t) {
            const int64_t p = pos0 + t;
            keys.clear();
            for (int64_t j = std::max<int64_t>(0, p - s.window + 1); j <= p; ++j) keys.push_back(row_at(j));
            if (lay.ratio > 0) {
                const int64_t n_valid = (p + 1) / lay.ratio;
                auto entry_row = [&](int64_t w) { return row_at(w * lay.ratio + lay.ratio - 1); };
                if (lay.ratio == 4 && n_valid > s.indexer_top_k) {
                    // Lightning indexer: sum_h w_h relu(q_h . k_w) / sqrt(Di), w_h = proj / sqrt(Hi).
                    score.assign(static_cast<size_t>(n_valid), 0.0f);
                    const float qscale = 1.0f / std::sqrt(static_cast<float>(Di));
                    const float wscale = 1.0f / std::sqrt(static_cast<float>(Hi));
                    const float* iq = in.idx_q + t * in.ld_idx_q;
                    const float* iw = in.idx_w + t * in.ld_idx_w;
                    for (int64_t w = 0; w < n_valid; ++w) {
                        const float* k = entry_row(w) + lay.idx_entry;
                        float sc = 0.0f;
                        for (int64_t hh = 0; hh < Hi; ++hh) {
                            const float* qh = iq + hh * Di;
                            float dot = 0.0f;
                            for (int64_t c = 0; c < Di; ++c) dot += qh[c] * k[c];
                            sc += std::max(dot, 0.0f) * qscale * (iw[hh] * wscale);
                        }
                        score[static_cast<size_t>(w)] = sc;
                    }
                    order.resize(static_cast<size_t>(n_valid));
                    std::iota(order.begin(), order.end(), 0);
                    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t c) {
                        return score[static_cast<size_t>(a)] > score[static_cast<size_t>(c)];
                    });
                    order.resize(static_cast<size_t>(s.indexer_top_k));
                    std::sort(order.begin(), order.end());
                    for (int64_t w : order) keys.push_back(entry_row(w) + lay.comp_entry);
                } else {
                    for (int64_t w = 0; w < n_valid; ++w) keys.push_back(entry_row(w) + lay.comp_entry);
                }
            }
            float* o = out + t * ldo;
            for (int64_t hh = 0; hh < H; ++hh)
                attend(in.q + t * in.ldq + hh * D, keys, D, s.scale, in.sinks[hh], o + hh * D);
            // V carried RoPE: rotate the output's rope dims back by the query's position.
            rope(o + nope, ldo, 1, H, D, -p, s.rope);
        }
    };
    // Bytes each query reads: its window and up to top_k (HCA: every) entry, all heads.
    const int64_t per_query = (s.window + std::max<int64_t>(s.indexer_top_k, pos0 / 128 + 1)) * D * H;
    pool.parallel_for_bytes(n_tokens, n_tokens * per_query * 4, queries);
}

}  // namespace sharpi::cpu
