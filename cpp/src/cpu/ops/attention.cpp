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

// Fast mode's block kernels; the ISA was validated by vec_kernels. AVX-512 CPUs run the AVX2 table
// (the block kernels are bound by loads and fma ports, not lane width, at these tile sizes).
const detail::AttentionBlockKernels& block_kernels(Isa isa) {
    return isa == Isa::scalar ? detail::attention_block_scalar() : detail::attention_block_avx2();
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
// Fast mode's tiles are larger: its kernels make the block decode (per tile) a larger share.
constexpr int64_t kFastTileRows = 64;

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

// Fast mode: row scores s[lo, hi) (block-relative) -> p over the 8-aligned span around them, the
// span's other entries -inf -> p = 0; returns l and sets *m. Entries outside the span are untouched.
float row_softmax(const detail::AttentionBlockKernels& bk, float* s, int64_t lo, int64_t hi, float* m) {
    const int64_t a = lo / detail::kAttentionLanes * detail::kAttentionLanes;
    const int64_t b = (hi + detail::kAttentionLanes - 1) / detail::kAttentionLanes * detail::kAttentionLanes;
    std::fill(s + a, s + lo, -INFINITY);
    std::fill(s + hi, s + b, -INFINITY);
    return bk.softmax(s, a, b, m);
}

// Fast mode's partials of n_rows query rows over one block of one KV head: row r has query q[r],
// reads the block-relative rows [lo[r], hi[r]) (lo < hi), and gets (m[r], l[r], o[r][0, head_dim)).
// The scores and the p . v pass run over the union of the rows' ranges; a row's entries outside its
// own range are p = 0 there, which adds exactly nothing. s: n_rows * kAttentionBlock floats.
void attend_block_fast(const detail::AttentionBlockKernels& bk, const float* const* q, const int64_t* lo,
                       const int64_t* hi, int64_t n_rows, const BlockRows& b, int64_t hd, float scale,
                       float* s, float* const* o, float* m, float* l) {
    int64_t union_lo = kAttentionBlock, union_hi = 0;
    for (int64_t r = 0; r < n_rows; ++r) {
        union_lo = std::min(union_lo, lo[r]);
        union_hi = std::max(union_hi, hi[r]);
    }
    bk.scores(q, n_rows, b.k, b.k_stride, union_lo, union_hi, hd, scale, s, kAttentionBlock);
    for (int64_t r = 0; r < n_rows; ++r) {
        float* sr = s + r * kAttentionBlock;
        l[r] = row_softmax(bk, sr, lo[r], hi[r], &m[r]);
        const int64_t span_lo = lo[r] / detail::kAttentionLanes * detail::kAttentionLanes;
        const int64_t span_hi =
            (hi[r] + detail::kAttentionLanes - 1) / detail::kAttentionLanes * detail::kAttentionLanes;
        if (union_lo < span_lo) std::fill(sr + union_lo, sr + span_lo, 0.0f);
        if (span_hi < union_hi) std::fill(sr + span_hi, sr + union_hi, 0.0f);
        std::fill(o[r], o[r] + hd, 0.0f);
    }
    bk.pv(s, kAttentionBlock, n_rows, b.v, b.v_stride, union_lo, union_hi, hd, o);
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
    const int64_t p = pos0 + t;
    const int64_t window_start = s.window > 0 ? std::max<int64_t>(0, p + 1 - s.window) : 0;
    const int64_t chunk_start = s.chunk > 0 ? p / s.chunk * s.chunk : 0;
    return std::max(window_start, chunk_start);
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

// Fast mode's split item: the partials of block [j0, j1) for every (token, head) row, with the
// kernels of attend_block_fast. Position-major like attend_block_all_heads: chunks of
// kSplitChunkRows whole K rows (all KV heads, consecutive bytes) give every row's scores, then each
// row's softmax, then chunks of whole V rows accumulate p . v. Per row and key the operations are
// attend_block_fast's (the same score, the same p, o accumulated over the keys in order), so the
// partials are the bits the tile path gets. slot(pair) -> (m, l, o[head_dim]).
constexpr int64_t kSplitChunkRows = 16;

struct SplitScratch {
    std::vector<float> rows, scores;
    std::vector<const float*> q;
    std::vector<float*> o;
    void reserve(int64_t width, int64_t n_pairs, int64_t group) {
        auto grow = [](auto& b, int64_t n) {
            if (static_cast<int64_t>(b.size()) < n) b.resize(static_cast<size_t>(n));
        };
        grow(rows, kSplitChunkRows * width);
        grow(scores, n_pairs * kAttentionBlock);
        grow(q, group);
        grow(o, group);
    }
};

template <class Slot>
void attend_block_all_heads_fast(const HeadKernels& kern, const detail::AttentionBlockKernels& bk,
                                 const float* q, int64_t ldq, const KvRows& k, const KvRows& v,
                                 int64_t n_tokens, int64_t pos0, int64_t j0, int64_t j1,
                                 const AttentionShape& s, int64_t width_k, int64_t width_v, Slot slot) {
    thread_local SplitScratch w;
    const int64_t hd = s.head_dim, group = s.n_head / s.n_head_kv, n_pairs = n_tokens * s.n_head;
    w.reserve(std::max(width_k, width_v), n_pairs, group);
    // Rows [c0, c1) of K or V: in place for f32 and f16 (the f16 kernels convert as they read),
    // else decoded whole to f32 into w.rows.
    struct Chunk {
        const float* f32 = nullptr;
        const uint16_t* f16 = nullptr;
        int64_t ld = 0;  // elements
    };
    auto chunk_rows = [&](const KvRows& kv, bool is_f32, DequantRowFn dequant, int64_t width, int64_t c0,
                          int64_t c1) -> Chunk {
        const uint8_t* base = kv.data + static_cast<size_t>(c0) * kv.row_bytes;
        if (is_f32)
            return {reinterpret_cast<const float*>(base), nullptr, static_cast<int64_t>(kv.row_bytes / 4)};
        if (kv.type == GgmlType::F16)
            return {nullptr, reinterpret_cast<const uint16_t*>(base), static_cast<int64_t>(kv.row_bytes / 2)};
        for (int64_t j = c0; j < c1; ++j)
            dequant(base + static_cast<size_t>(j - c0) * kv.row_bytes, w.rows.data() + (j - c0) * width,
                    width);
        return {w.rows.data(), nullptr, width};
    };
    // Chunks of whole rows of K or V in order; for each, the (token, KV head) row groups reading it:
    // f(rows, c0, t, g, first, last), [first, last) the chunk-relative key range of token t.
    auto for_each_chunk = [&](const KvRows& kv, bool is_f32, DequantRowFn dequant, int64_t width, auto f) {
        for (int64_t c0 = j0; c0 < j1; c0 += kSplitChunkRows) {
            const int64_t c1 = std::min(c0 + kSplitChunkRows, j1);
            const Chunk rows = chunk_rows(kv, is_f32, dequant, width, c0, c1);
            for (int64_t t = 0; t < n_tokens; ++t) {
                int64_t lo, hi;
                block_range(s, pos0, t, j0, j1, &lo, &hi);
                const int64_t first = std::max(lo, c0 - j0) - (c0 - j0),
                              last = std::min(hi, c1 - j0) - (c0 - j0);
                if (first >= last) continue;
                for (int64_t g = 0; g < s.n_head_kv; ++g) f(rows, c0, t, g, first, last);
            }
        }
    };
    for_each_chunk(k, kern.k_is_f32, kern.dequant_k, width_k,
                   [&](const Chunk& rows, int64_t c0, int64_t t, int64_t g, int64_t first, int64_t last) {
                       for (int64_t i = 0; i < group; ++i)
                           w.q[static_cast<size_t>(i)] = q + t * ldq + (g * group + i) * hd;
                       float* sc = w.scores.data() + (t * s.n_head + g * group) * kAttentionBlock + (c0 - j0);
                       if (rows.f16 != nullptr) {
                           bk.scores_f16(w.q.data(), group, rows.f16 + g * hd, rows.ld, first, last, hd,
                                         s.scale, sc, kAttentionBlock);
                       } else {
                           bk.scores(w.q.data(), group, rows.f32 + g * hd, rows.ld, first, last, hd, s.scale,
                                     sc, kAttentionBlock);
                       }
                   });
    for (int64_t pair = 0; pair < n_pairs; ++pair) {
        int64_t lo, hi;
        block_range(s, pos0, pair / s.n_head, j0, j1, &lo, &hi);
        if (lo >= hi) continue;
        float* o = slot(pair);
        o[1] = row_softmax(bk, w.scores.data() + pair * kAttentionBlock, lo, hi, &o[0]);
        std::fill(o + 2, o + 2 + hd, 0.0f);
    }
    for_each_chunk(
        v, kern.v_is_f32, kern.dequant_v, width_v,
        [&](const Chunk& rows, int64_t c0, int64_t t, int64_t g, int64_t first, int64_t last) {
            for (int64_t i = 0; i < group; ++i)
                w.o[static_cast<size_t>(i)] = slot(t * s.n_head + g * group + i) + 2;
            const float* p = w.scores.data() + (t * s.n_head + g * group) * kAttentionBlock + (c0 - j0);
            if (rows.f16 != nullptr) {
                bk.pv_f16(p, kAttentionBlock, group, rows.f16 + g * hd, rows.ld, first, last, hd, w.o.data());
            } else {
                bk.pv(p, kAttentionBlock, group, rows.f32 + g * hd, rows.ld, first, last, hd, w.o.data());
            }
        });
}

// Scratch of one thread: a decoded block of K and V, and per tile row its running state. Kept per
// pool thread (thread_local, grown on demand) so a call allocates nothing after the first: about
// (2 * kAttentionBlock + kTileRows + 1) * head_dim floats, 270 KiB per thread at head_dim 128,
// inside the 8 MiB the budget planner charges for "the rest" (memory_plan.h) up to 16 threads.
// Fast mode's tiles have kFastTileRows rows, each with a block's scores and a partial o besides:
// (2 * kAttentionBlock + kFastTileRows * (kAttentionBlock + 2 * head_dim)) * 4 bytes, 384 KiB per
// thread at head_dim 128, still inside those 8 MiB up to 16 threads.
struct TileScratch {
    std::vector<float> k_buf, v_buf, acc_o, part_o, scores, m, l;
    std::vector<Partial> acc;
    std::vector<const float*> q;
    std::vector<float*> o;
    std::vector<int64_t> lo, hi, row;
    void reserve(int64_t tile_rows, int64_t hd) {
        auto grow = [](auto& b, int64_t n) {
            if (static_cast<int64_t>(b.size()) < n) b.resize(static_cast<size_t>(n));
        };
        grow(k_buf, kAttentionBlock * hd);
        grow(v_buf, kAttentionBlock * hd);
        grow(acc_o, tile_rows * hd);
        grow(part_o, tile_rows * hd);
        grow(scores, tile_rows * kAttentionBlock);
        for (auto* b : {&m, &l}) grow(*b, tile_rows);
        for (auto* b : {&lo, &hi, &row}) grow(*b, tile_rows);
        grow(q, tile_rows);
        grow(o, tile_rows);
        grow(acc, tile_rows);
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
    const detail::AttentionBlockKernels& bk = block_kernels(isa);
    const bool fast = !s.exact && s.head_dim % detail::kAttentionLanes == 0;
    const size_t k_head_bytes = ggml_row_size(k.type, s.head_dim);
    const size_t v_head_bytes = ggml_row_size(v.type, s.head_dim);
    const int64_t n_pairs = n_tokens * s.n_head;
    const int64_t max_blocks = n_blocks(pos0 + n_tokens);
    const int64_t hd = s.head_dim;
    // Work is cut into tiles of tile_tokens tokens x one KV head (tile_tokens * group query rows).
    const int64_t tile_tokens =
        std::max<int64_t>(1, std::min(n_tokens, (fast ? kFastTileRows : kTileRows) / group));
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

    // Fast mode's tiles copy an f32 block to contiguous rows too: a head's rows read in place sit a
    // cache row apart (a page or more for wide layers), and the register tiles read several of them
    // at once; the copy is shared by the tile's rows. Exact mode reads them in place as before.
    HeadKernels tile_kern = kern;
    if (fast) tile_kern.k_is_f32 = tile_kern.v_is_f32 = false;

    // What the call reads, for parallel_for_bytes: every tile reads its KV head's rows up to its last
    // token. Decoding over a short context is a few microseconds of work, less than waking the pool
    // and meeting it at the barrier (benchmarks/bench_threadpool.py measured it on stdlib-moe).
    const int64_t kv_bytes =
        (pos0 + n_tokens) * static_cast<int64_t>(k_head_bytes + v_head_bytes) * s.n_head_kv * n_tiles;

    if (!split_blocks(n_tokens, n_pairs, max_blocks, hd)) {
        const int64_t n_items = n_tiles * s.n_head_kv;
        pool.parallel_for_bytes(
            n_items, kv_bytes,
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
                    // The tile's first token starts the earliest (a window or chunk start only moves
                    // forward).
                    for (int64_t j0 = first_kv(s, pos0, t0) / kAttentionBlock * kAttentionBlock;
                         j0 < n_kv_last; j0 += kAttentionBlock) {
                        const int64_t j1 = std::min(j0 + kAttentionBlock, n_kv_last);
                        const BlockRows b =
                            load_block(tile_kern, k, v, static_cast<size_t>(kvh) * k_head_bytes,
                                       static_cast<size_t>(kvh) * v_head_bytes, k_head_bytes, v_head_bytes,
                                       j0, j1, hd, w.k_buf.data(), w.v_buf.data());
                        if (fast) {
                            int64_t n_active = 0;  // the rows that read this block
                            for (int64_t r = 0; r < n_rows; ++r) {
                                const int64_t t = t0 + r / group, h = kvh * group + r % group;
                                const size_t i = static_cast<size_t>(n_active);
                                block_range(s, pos0, t, j0, j1, &w.lo[i], &w.hi[i]);
                                if (w.lo[i] >= w.hi[i]) continue;
                                w.q[i] = q + t * ldq + h * hd;
                                w.o[i] = w.part_o.data() + n_active * hd;
                                w.row[i] = r;
                                ++n_active;
                            }
                            attend_block_fast(bk, w.q.data(), w.lo.data(), w.hi.data(), n_active, b, hd,
                                              s.scale, w.scores.data(), w.o.data(), w.m.data(), w.l.data());
                            for (size_t i = 0; i < static_cast<size_t>(n_active); ++i) {
                                merge(kern, w.acc[static_cast<size_t>(w.row[i])],
                                      Partial{w.m[i], w.l[i], w.o[i]}, hd);
                            }
                            continue;
                        }
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
    pool.parallel_for_bytes(
        max_blocks, kv_bytes,
        [&](int64_t begin, int64_t end, int) {
            for (int64_t blk = begin; blk < end; ++blk) {
                const int64_t j0 = blk * kAttentionBlock,
                              j1 = std::min(j0 + kAttentionBlock, pos0 + n_tokens);
                auto slot = [&](int64_t pair) {
                    return partials.data() + (pair * max_blocks + blk) * stride;
                };
                if (fast) {
                    attend_block_all_heads_fast(kern, bk, q, ldq, k, v, n_tokens, pos0, j0, j1, s, width_k,
                                                width_v, slot);
                } else {
                    attend_block_all_heads(kern, q, ldq, k, v, n_tokens, pos0, j0, j1, s, width_k, width_v,
                                           slot);
                }
            }
        },
        max_blocks);
    const int64_t partial_bytes = static_cast<int64_t>(partials.size() * sizeof(float));
    pool.parallel_for_bytes(n_pairs, partial_bytes, [&](int64_t begin, int64_t end, int) {
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

void attention_block_partial(Isa isa, const float* q, int64_t n_rows, const float* k, const float* v,
                             int64_t n_keys, int64_t head_dim, const int64_t* lo, const int64_t* hi,
                             float scale, float* m, float* l, float* o) {
    vec_kernels(isa);  // rejects an ISA this CPU lacks
    if (head_dim <= 0 || head_dim % detail::kAttentionLanes != 0 || n_keys > kAttentionBlock || n_rows < 0) {
        throw InvalidArgument(
            "[attention] block kernels: head_dim must be a positive multiple of 8 and at most " +
            std::to_string(kAttentionBlock) + " keys");
    }
    std::vector<const float*> q_rows(static_cast<size_t>(n_rows));
    std::vector<float*> o_rows(static_cast<size_t>(n_rows));
    for (int64_t r = 0; r < n_rows; ++r) {
        if (lo[r] < 0 || lo[r] >= hi[r] || hi[r] > n_keys) {
            throw InvalidArgument("[attention] block kernels: row " + std::to_string(r) +
                                  " needs 0 <= lo < hi <= " + std::to_string(n_keys));
        }
        q_rows[static_cast<size_t>(r)] = q + r * head_dim;
        o_rows[static_cast<size_t>(r)] = o + r * head_dim;
    }
    std::vector<float> scores(static_cast<size_t>(n_rows * kAttentionBlock));
    attend_block_fast(block_kernels(isa), q_rows.data(), lo, hi, n_rows, BlockRows{k, head_dim, v, head_dim},
                      head_dim, scale, scores.data(), o_rows.data(), m, l);
}

}  // namespace sharpi::cpu
