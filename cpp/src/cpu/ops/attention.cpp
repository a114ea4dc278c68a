#include "cpu/ops/attention.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "cpu/ops/attention_kernels.h"
#include "sharpi/errors.h"

namespace sharpi::cpu {

namespace {

const detail::AttentionVecKernels& vec_kernels(Isa isa) {
    if (static_cast<int>(isa) > static_cast<int>(detect_isa())) {
        throw InvalidArgument(std::string("[attention] ISA ") + isa_name(isa) +
                              " requested, but this CPU runs at most " + isa_name(detect_isa()));
    }
    switch (isa) {
        case Isa::avx512:
            return detail::attention_vec_avx512();
        case Isa::avx2:
            return detail::attention_vec_avx2();
        case Isa::scalar:
            break;
    }
    return detail::attention_vec_scalar();
}

// The running softmax state of one (token, head): M, L and O[head_dim] (header comment).
struct Partial {
    float m = -INFINITY;
    float l = 0.0f;
    float* o = nullptr;
};

// The kernels of one call: K and V rows decoded to f32 by their stored type's row kernels, then
// dotted with the query by the f32 row kernel. For one ISA dot_row(w, x) is bit-identical to
// dot_f32(dequant_row(w), x) (cpu/quant/kernels.h), so decoding a block once for every query row
// that reads it gives the scores a per-row dot_row would, bit for bit.
struct HeadKernels {
    DequantRowFn dequant_k;
    DequantRowFn dequant_v;
    DotRowFn dot_f32;
    const detail::AttentionVecKernels* vec;
    bool k_is_f32;
    bool v_is_f32;
};

// Query rows that read the same KV rows: the `group` query heads of one KV head, for a tile of
// consecutive tokens. Each decoded block is shared by up to kTileRows rows.
constexpr int64_t kTileRows = 32;

// Rows [j0, j1) of one KV head as f32 rows: pointers into the cache for f32, else decoded into
// the caller's buffers (kAttentionBlock * head_dim floats each).
struct BlockRows {
    const float* k = nullptr;
    int64_t k_stride = 0;  // floats from row j to row j + 1
    const float* v = nullptr;
    int64_t v_stride = 0;
};

// One head's row of a position is a few cache lines, and the next position's is a whole cache row
// (all KV heads) further on: a stride the hardware prefetchers do not follow across pages, so
// without help every position costs a memory latency. Rows are fetched this far ahead.
constexpr int64_t kPrefetchRows = 32;

void prefetch_head_row(const uint8_t* p, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 1);
}

BlockRows load_block(const HeadKernels& kern, const KvRows& k, const KvRows& v, size_t k_off, size_t v_off,
                     size_t k_head_bytes, size_t v_head_bytes, int64_t j0, int64_t j1, int64_t hd,
                     float* k_buf, float* v_buf) {
    auto decode = [&](const KvRows& kv, size_t off, size_t head_bytes, bool is_f32, DequantRowFn dequant,
                      float* buf, const float** rows, int64_t* stride) {
        const uint8_t* base = kv.data + off;
        if (is_f32) {
            // Read in place: fetch the block's rows now (to L2), so the dots and axpys stream.
            for (int64_t j = j0; j < j1; ++j)
                prefetch_head_row(base + static_cast<size_t>(j) * kv.row_bytes, head_bytes);
            *rows = reinterpret_cast<const float*>(base + static_cast<size_t>(j0) * kv.row_bytes);
            *stride = static_cast<int64_t>(kv.row_bytes / sizeof(float));
            return;
        }
        for (int64_t j = j0; j < std::min(j1, j0 + kPrefetchRows); ++j)
            prefetch_head_row(base + static_cast<size_t>(j) * kv.row_bytes, head_bytes);
        for (int64_t j = j0; j < j1; ++j) {
            if (j + kPrefetchRows < j1)
                prefetch_head_row(base + static_cast<size_t>(j + kPrefetchRows) * kv.row_bytes, head_bytes);
            dequant(base + static_cast<size_t>(j) * kv.row_bytes, buf + (j - j0) * hd, hd);
        }
        *rows = buf;
        *stride = hd;
    };
    BlockRows b;
    decode(k, k_off, k_head_bytes, kern.k_is_f32, kern.dequant_k, k_buf, &b.k, &b.k_stride);
    decode(v, v_off, v_head_bytes, kern.v_is_f32, kern.dequant_v, v_buf, &b.v, &b.v_stride);
    return b;
}

// Partial softmax of one query row over the block's rows [lo, hi) (relative to the block's first,
// hi <= kAttentionBlock) into part (o: head_dim floats, overwritten).
void attend_rows(const HeadKernels& kern, const float* qh, const BlockRows& b, int64_t lo, int64_t hi,
                 const AttentionShape& s, Partial& part) {
    float scores[kAttentionBlock];
    float m = -INFINITY;
    for (int64_t j = lo; j < hi; ++j) {
        const float sc = kern.dot_f32(b.k + j * b.k_stride, qh, s.head_dim) * s.scale;
        scores[j] = sc;
        m = std::max(m, sc);
    }
    std::fill(part.o, part.o + s.head_dim, 0.0f);
    float l = 0.0f;
    for (int64_t j = lo; j < hi; ++j) {
        const float p = std::exp(scores[j] - m);
        l += p;
        kern.vec->axpy(p, b.v + j * b.v_stride, part.o, s.head_dim);
    }
    part.m = m;
    part.l = l;
}

void merge(const HeadKernels& kern, Partial& acc, const Partial& part, int64_t head_dim) {
    const float m = std::max(acc.m, part.m);
    const float a = std::exp(acc.m - m), b = std::exp(part.m - m);
    acc.l = acc.l * a + part.l * b;
    kern.vec->scale(a, acc.o, head_dim);
    kern.vec->axpy(b, part.o, acc.o, head_dim);
    acc.m = m;
}

void finish(const HeadKernels& kern, const Partial& acc, float* out, int64_t head_dim) {
    std::copy(acc.o, acc.o + head_dim, out);
    kern.vec->scale(1.0f / acc.l, out, head_dim);
}

int64_t n_blocks(int64_t n_kv) {
    return (n_kv + kAttentionBlock - 1) / kAttentionBlock;
}

// The first cache position token t (at position pos0 + t) attends to.
int64_t first_kv(const AttentionShape& s, int64_t pos0, int64_t t) {
    return s.window > 0 ? std::max<int64_t>(0, pos0 + t + 1 - s.window) : 0;
}

// The running state before any block: a sink's logit counts once in L (exp(sink - M) at M = sink).
Partial initial_state(const AttentionShape& s, int64_t h, float* o) {
    std::fill(o, o + s.head_dim, 0.0f);
    return s.sinks ? Partial{s.sinks[h], 1.0f, o} : Partial{-INFINITY, 0.0f, o};
}

// The rows [lo, hi) of block [j0, j1) token t reads, relative to j0 (lo >= hi: none).
void block_range(const AttentionShape& s, int64_t pos0, int64_t t, int64_t j0, int64_t j1, int64_t* lo,
                 int64_t* hi) {
    *lo = std::max(j0, first_kv(s, pos0, t)) - j0;
    *hi = std::min(j1, pos0 + t + 1) - j0;
}

// Decoding (a few tokens) over more than one block: every block is a work item over all heads
// (position-major, below), the partials merged afterwards, when they fit the bounded buffer.
bool split_blocks(int64_t n_tokens, int64_t n_pairs, int64_t max_blocks, int64_t head_dim) {
    return max_blocks > 1 && n_tokens <= kAttentionSplitMaxTokens &&
           n_pairs * max_blocks * (head_dim + 2) <= kAttentionSplitMaxFloats;
}

// Partials (m, l, o) of block [j0, j1) for every (token, head) row of the batch, reading each
// position's whole K row and then its whole V row (all KV heads: consecutive bytes, so the reads
// stream) instead of one head's slice at a time (a cache row apart from the next position's).
// A row decoded whole equals its heads decoded one by one (heads are whole blocks), and scores,
// l and o are accumulated per row in the same order as attend_rows, so the partials are its bits.
// slot(pair) -> (m, l, o[head_dim]) destination; rows with n_kv <= j0 are skipped.
struct PositionScratch {
    std::vector<float> kf, vf, scores, m, l;
    void reserve(int64_t width, int64_t n_pairs) {
        if (static_cast<int64_t>(m.size()) < n_pairs) m.resize(static_cast<size_t>(n_pairs));
        if (static_cast<int64_t>(l.size()) < n_pairs) l.resize(static_cast<size_t>(n_pairs));
        if (static_cast<int64_t>(kf.size()) < width) kf.resize(static_cast<size_t>(width));
        if (static_cast<int64_t>(vf.size()) < width) vf.resize(static_cast<size_t>(width));
        if (static_cast<int64_t>(scores.size()) < n_pairs * kAttentionBlock)
            scores.resize(static_cast<size_t>(n_pairs * kAttentionBlock));
    }
};

template <class Slot>
void attend_block_all_heads(const HeadKernels& kern, const float* q, int64_t ldq, const KvRows& k,
                            const KvRows& v, int64_t n_tokens, int64_t pos0, int64_t j0, int64_t j1,
                            const AttentionShape& s, int64_t width_k, int64_t width_v, Slot slot) {
    thread_local PositionScratch w;
    const int64_t hd = s.head_dim, group = s.n_head / s.n_head_kv, n_pairs = n_tokens * s.n_head;
    w.reserve(std::max(width_k, width_v), n_pairs);
    auto reads = [&](int64_t t, int64_t jr) {  // whether token t reads block row jr (relative to j0)
        int64_t lo, hi;
        block_range(s, pos0, t, j0, j1, &lo, &hi);
        return jr >= lo && jr < hi;
    };
    for (int64_t j = j0; j < j1; ++j) {
        const uint8_t* krow = k.data + static_cast<size_t>(j) * k.row_bytes;
        if (j + kPrefetchRows < j1) prefetch_head_row(krow + kPrefetchRows * k.row_bytes, k.row_bytes);
        const float* kf = reinterpret_cast<const float*>(krow);
        if (!kern.k_is_f32) {
            kern.dequant_k(krow, w.kf.data(), width_k);
            kf = w.kf.data();
        }
        for (int64_t t = 0; t < n_tokens; ++t) {
            if (!reads(t, j - j0)) continue;
            for (int64_t h = 0; h < s.n_head; ++h) {
                w.scores[static_cast<size_t>((t * s.n_head + h) * kAttentionBlock + (j - j0))] =
                    kern.dot_f32(kf + (h / group) * hd, q + t * ldq + h * hd, hd) * s.scale;
            }
        }
    }
    float* m = w.m.data();
    float* l = w.l.data();
    std::fill(m, m + n_pairs, -INFINITY);
    std::fill(l, l + n_pairs, 0.0f);
    for (int64_t pair = 0; pair < n_pairs; ++pair) {
        int64_t lo, hi;
        block_range(s, pos0, pair / s.n_head, j0, j1, &lo, &hi);
        const float* sc = w.scores.data() + pair * kAttentionBlock;
        for (int64_t j = lo; j < hi; ++j) m[pair] = std::max(m[pair], sc[j]);
        if (lo < hi) std::fill(slot(pair) + 2, slot(pair) + 2 + hd, 0.0f);
    }
    for (int64_t j = j0; j < j1; ++j) {
        const uint8_t* vrow = v.data + static_cast<size_t>(j) * v.row_bytes;
        if (j + kPrefetchRows < j1) prefetch_head_row(vrow + kPrefetchRows * v.row_bytes, v.row_bytes);
        const float* vf = reinterpret_cast<const float*>(vrow);
        if (!kern.v_is_f32) {
            kern.dequant_v(vrow, w.vf.data(), width_v);
            vf = w.vf.data();
        }
        for (int64_t pair = 0; pair < n_pairs; ++pair) {
            if (!reads(pair / s.n_head, j - j0)) continue;
            const float p =
                std::exp(w.scores[static_cast<size_t>(pair * kAttentionBlock + (j - j0))] - m[pair]);
            l[pair] += p;
            kern.vec->axpy(p, vf + ((pair % s.n_head) / group) * hd, slot(pair) + 2, hd);
        }
    }
    for (int64_t pair = 0; pair < n_pairs; ++pair) {
        int64_t lo, hi;
        block_range(s, pos0, pair / s.n_head, j0, j1, &lo, &hi);
        if (lo >= hi) continue;
        float* o = slot(pair);
        o[0] = m[pair];
        o[1] = l[pair];
    }
}

// Scratch of one thread: a decoded block of K and V, and per tile row its running state. Kept per
// pool thread (thread_local, grown on demand) so a call allocates nothing after the first: about
// (2 * kAttentionBlock + kTileRows + 1) * head_dim floats, 270 KiB per thread at head_dim 128,
// inside the 8 MiB the budget planner charges for "the rest" (memory_plan.h) up to 16 threads.
struct TileScratch {
    std::vector<float> k_buf, v_buf, acc_o, part_o;
    std::vector<Partial> acc;
    void reserve(int64_t tile_rows, int64_t hd) {
        auto grow = [](std::vector<float>& b, int64_t n) {
            if (static_cast<int64_t>(b.size()) < n) b.resize(static_cast<size_t>(n));
        };
        grow(k_buf, kAttentionBlock * hd);
        grow(v_buf, kAttentionBlock * hd);
        grow(acc_o, tile_rows * hd);
        grow(part_o, hd);
        if (static_cast<int64_t>(acc.size()) < tile_rows) acc.resize(static_cast<size_t>(tile_rows));
    }
};

TileScratch& thread_scratch(int64_t tile_rows, int64_t hd) {
    thread_local TileScratch scratch;
    scratch.reserve(tile_rows, hd);
    return scratch;
}

}  // namespace

void attention(ThreadPool& pool, const float* q, int64_t ldq, const KvRows& k, const KvRows& v,
               int64_t n_tokens, int64_t pos0, const AttentionShape& s, float* out, int64_t ldo, Isa isa) {
    const int64_t group = s.n_head / s.n_head_kv;
    const HeadKernels kern{row_kernels(k.type, isa).dequant_row,
                           row_kernels(v.type, isa).dequant_row,
                           row_kernels(GgmlType::F32, isa).dot_row,
                           &vec_kernels(isa),
                           k.type == GgmlType::F32,
                           v.type == GgmlType::F32};
    const size_t k_head_bytes = ggml_row_size(k.type, s.head_dim);
    const size_t v_head_bytes = ggml_row_size(v.type, s.head_dim);
    const int64_t n_pairs = n_tokens * s.n_head;
    const int64_t max_blocks = n_blocks(pos0 + n_tokens);
    const int64_t hd = s.head_dim;
    // Work is cut into tiles of tile_tokens tokens x one KV head (tile_tokens * group query rows).
    const int64_t tile_tokens = std::max<int64_t>(1, std::min(n_tokens, kTileRows / group));
    const int64_t n_tiles = (n_tokens + tile_tokens - 1) / tile_tokens;
    const int64_t tile_rows = tile_tokens * group;
    // Tile item -> (first token, last token + 1, KV head); later tokens read more blocks, so items
    // run from the last tile to the first and every item is its own chunk (threads balance).
    auto tile_of = [&](int64_t item, int64_t* t0, int64_t* t1, int64_t* kvh) {
        const int64_t tile = n_tiles - 1 - item / s.n_head_kv;
        *kvh = item % s.n_head_kv;
        *t0 = tile * tile_tokens;
        *t1 = std::min(n_tokens, *t0 + tile_tokens);
    };

    if (!split_blocks(n_tokens, n_pairs, max_blocks, hd)) {
        const int64_t n_items = n_tiles * s.n_head_kv;
        pool.parallel_for(
            n_items,
            [&](int64_t begin, int64_t end, int) {
                TileScratch& w = thread_scratch(tile_rows, hd);
                for (int64_t item = begin; item < end; ++item) {
                    int64_t t0, t1, kvh;
                    tile_of(item, &t0, &t1, &kvh);
                    const int64_t n_rows = (t1 - t0) * group;
                    for (int64_t r = 0; r < n_rows; ++r) {
                        w.acc[static_cast<size_t>(r)] =
                            initial_state(s, kvh * group + r % group, w.acc_o.data() + r * hd);
                    }
                    const int64_t n_kv_last = pos0 + t1;  // the tile's last token reads the most rows
                    // The tile's first token starts the earliest (a sliding window only moves forward).
                    for (int64_t j0 = first_kv(s, pos0, t0) / kAttentionBlock * kAttentionBlock;
                         j0 < n_kv_last; j0 += kAttentionBlock) {
                        const int64_t j1 = std::min(j0 + kAttentionBlock, n_kv_last);
                        const BlockRows b =
                            load_block(kern, k, v, static_cast<size_t>(kvh) * k_head_bytes,
                                       static_cast<size_t>(kvh) * v_head_bytes, k_head_bytes, v_head_bytes,
                                       j0, j1, hd, w.k_buf.data(), w.v_buf.data());
                        for (int64_t r = 0; r < n_rows; ++r) {
                            const int64_t t = t0 + r / group, h = kvh * group + r % group;
                            int64_t lo, hi;
                            block_range(s, pos0, t, j0, j1, &lo, &hi);
                            if (lo >= hi) continue;
                            Partial part{-INFINITY, 0.0f, w.part_o.data()};
                            attend_rows(kern, q + t * ldq + h * hd, b, lo, hi, s, part);
                            merge(kern, w.acc[static_cast<size_t>(r)], part, hd);
                        }
                    }
                    for (int64_t r = 0; r < n_rows; ++r) {
                        const int64_t t = t0 + r / group, h = kvh * group + r % group;
                        finish(kern, w.acc[static_cast<size_t>(r)], out + t * ldo + h * hd, hd);
                    }
                }
            },
            n_items);
        return;
    }

    // Split: partial (m, l, o) of every (pair, block) first, then each pair merges its blocks in order.
    const int64_t stride = hd + 2;
    std::vector<float> partials(static_cast<size_t>(n_pairs * max_blocks * stride));
    const int64_t width_k = s.n_head_kv * hd, width_v = s.n_head_kv * hd;
    pool.parallel_for(
        max_blocks,
        [&](int64_t begin, int64_t end, int) {
            for (int64_t blk = begin; blk < end; ++blk) {
                const int64_t j0 = blk * kAttentionBlock,
                              j1 = std::min(j0 + kAttentionBlock, pos0 + n_tokens);
                attend_block_all_heads(
                    kern, q, ldq, k, v, n_tokens, pos0, j0, j1, s, width_k, width_v,
                    [&](int64_t pair) { return partials.data() + (pair * max_blocks + blk) * stride; });
            }
        },
        max_blocks);
    pool.parallel_for(n_pairs, [&](int64_t begin, int64_t end, int) {
        std::vector<float> o(static_cast<size_t>(hd));
        for (int64_t pair = begin; pair < end; ++pair) {
            const int64_t t = pair / s.n_head, h = pair % s.n_head;
            const int64_t n_kv = pos0 + t + 1;
            Partial acc = initial_state(s, h, o.data());
            for (int64_t blk = first_kv(s, pos0, t) / kAttentionBlock; blk < n_blocks(n_kv); ++blk) {
                float* slot = partials.data() + (pair * max_blocks + blk) * stride;
                merge(kern, acc, Partial{slot[0], slot[1], slot + 2}, hd);
            }
            finish(kern, acc, out + t * ldo + h * hd, hd);
        }
    });
}

}  // namespace sharpi::cpu
