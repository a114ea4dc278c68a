// Quantized weight matrix times f32 activations (see matmul.h).
//
// Owns nothing but thread-local scratch, reused across calls and sized to the largest call seen:
// per pool thread, dequantized rows (exact prefill); on the calling thread, the quantized
// activation rows (fast mode), which the pool's threads only read. Called from the decode thread;
// runs its body on the pool. Every Y element is a fixed function of (weight row, token): exact mode
// dot_row for one token and dot_f32 on the dequantized row for several (bit-identical for one ISA,
// kernels.h); fast mode vec_dot for one token and vec_dot_tile for several (bit-identical, qdot.h).
// So Y never depends on n_tokens, the thread count, the tiling or timing.
#include "cpu/ops/matmul.h"

#include <algorithm>
#include <string>
#include <vector>

#include "cpu/quant/kernels.h"
#include "sharpi/errors.h"

namespace sharpi::cpu {

namespace {

// Prefill tiling: a tile of weight rows is dequantized into scratch and dotted with a block of
// tokens, so that the tile (kTileBytes) stays in L1/L2 while the token block (kTokenBlockBytes of
// activations) streams from L2. Rows are re-dequantized once per token block; with at least
// kMinTokenBlock tokens per block that costs little next to the dots.
constexpr size_t kTileBytes = 32 * 1024;
constexpr size_t kTokenBlockBytes = 1024 * 1024;
constexpr int64_t kMinTokenBlock = 16;
// Fast-mode prefill: weight rows per block of the row loop (matmul_quantized), to stay in L2.
constexpr size_t kQuantRowBlockBytes = 256 * 1024;

std::string weight_desc(const WeightView& w) {
    return std::string("[matmul] ") + ggml_type_traits(w.type).name + " weight [" + std::to_string(w.n_rows) +
           ", " + std::to_string(w.n_cols) + "]";
}

void validate(const WeightView& w, const float* x, int64_t ldx, int64_t n_tokens, const float* y,
              int64_t ldy) {
    const GgmlTypeTraits& traits = ggml_type_traits(w.type);
    if (w.n_rows < 0 || w.n_cols < 0 || n_tokens < 0) {
        throw InvalidArgument(weight_desc(w) + ": negative size (n_tokens " + std::to_string(n_tokens) + ")");
    }
    if (traits.block_size > 0 && w.n_cols % traits.block_size != 0) {
        throw InvalidArgument(weight_desc(w) + ": n_cols is not a multiple of the block size " +
                              std::to_string(traits.block_size));
    }
    if (w.row_bytes != ggml_row_size(w.type, w.n_cols)) {
        throw InvalidArgument(weight_desc(w) + ": row_bytes " + std::to_string(w.row_bytes) + ", expected " +
                              std::to_string(ggml_row_size(w.type, w.n_cols)));
    }
    if (ldx < w.n_cols || ldy < w.n_rows) {
        throw InvalidArgument(weight_desc(w) + ": ldx " + std::to_string(ldx) + " < n_cols or ldy " +
                              std::to_string(ldy) + " < n_rows");
    }
    if (w.n_rows > 0 && w.n_cols > 0 && n_tokens > 0 && (w.data == nullptr || x == nullptr || y == nullptr)) {
        throw InvalidArgument(weight_desc(w) + ": null data pointer");
    }
}

// The integer kernels fast mode uses for `type`, or nullptr for the f32 path: in exact mode, for
// types without integer kernels, and on Isa::scalar, where the portable integer kernels are only
// the reference (measured slower than the f32 path: prefill ~0.5 vs ~9 Gmac/s on Q8_0), so a CPU
// without AVX2 computes fast mode with exact mode's arithmetic.
const QuantDotKernels* fast_kernels(GgmlType type, Isa isa, bool exact) {
    if (exact || isa == Isa::scalar) return nullptr;
    return quant_dot_kernels(type, isa);
}

// Fast mode (matmul.h): quantize each token row once, then vec_dot / vec_dot_tile per weight row.
void matmul_quantized(ThreadPool& pool, const WeightView& w, const QuantDotKernels& kernels, Isa isa,
                      const float* x, int64_t ldx, int64_t n_tokens, float* y, int64_t ldy) {
    const ActFormat format = act_format(w.type);
    const QuantizeActFn quantize = quantize_act_kernel(format, isa);
    const size_t xq_bytes = act_row_bytes(format, w.n_cols);
    // Decode-thread scratch, reused across calls; the pool's threads only read it.
    thread_local std::vector<uint8_t> xq;
    if (xq.size() < xq_bytes * static_cast<size_t>(n_tokens))
        xq.resize(xq_bytes * static_cast<size_t>(n_tokens));
    uint8_t* xq_data = xq.data();
    const int64_t n = w.n_cols;
    const int64_t weight_bytes = w.n_rows * static_cast<int64_t>(w.row_bytes);
    if (n_tokens == 1) {
        quantize(x, xq_data, n);
        const VecDotFn vec_dot = kernels.vec_dot;
        pool.parallel_for_bytes(w.n_rows, weight_bytes, [&](int64_t begin, int64_t end, int) {
            for (int64_t r = begin; r < end; ++r)
                y[r] = vec_dot(w.data + static_cast<size_t>(r) * w.row_bytes, xq_data, n);
        });
        return;
    }
    pool.parallel_for_bytes(n_tokens, n_tokens * n * static_cast<int64_t>(sizeof(float)),
                            [&](int64_t begin, int64_t end, int) {
                                for (int64_t t = begin; t < end; ++t)
                                    quantize(x + t * ldx, xq_data + static_cast<size_t>(t) * xq_bytes, n);
                            });
    pool.parallel_for_bytes(w.n_rows, weight_bytes * n_tokens, [&](int64_t begin, int64_t end, int) {
        quantized_rows(w, kernels, xq_data, xq_bytes, n_tokens, begin, end, y, ldy);
    });
}

}  // namespace

void matmul(ThreadPool& pool, const WeightView& w, const float* x, int64_t ldx, int64_t n_tokens, float* y,
            int64_t ldy, bool exact) {
    const Isa isa = active_isa();
    const RowKernels& kernels = row_kernels(w.type, isa);  // UnsupportedError names the type
    validate(w, x, ldx, n_tokens, y, ldy);
    if (w.n_rows == 0 || n_tokens == 0) return;
    if (w.n_cols == 0) {
        for (int64_t t = 0; t < n_tokens; ++t) {
            for (int64_t r = 0; r < w.n_rows; ++r) y[t * ldy + r] = 0.0f;
        }
        return;
    }
    if (!exact) {
        if (const QuantDotKernels* qk = fast_kernels(w.type, isa, exact)) {
            matmul_quantized(pool, w, *qk, isa, x, ldx, n_tokens, y, ldy);
            return;
        }
    }

    const int64_t weight_bytes = w.n_rows * static_cast<int64_t>(w.row_bytes);
    if (n_tokens == 1) {
        // Decode: memory-bound; each thread streams its contiguous share of the rows once.
        const DotRowFn dot_row = kernels.dot_row;
        pool.parallel_for_bytes(w.n_rows, weight_bytes, [&](int64_t begin, int64_t end, int) {
            for (int64_t r = begin; r < end; ++r) {
                y[r] = dot_row(w.data + static_cast<size_t>(r) * w.row_bytes, x, w.n_cols);
            }
        });
        return;
    }

    // Prefill.
    const DequantRowFn dequant_row = kernels.dequant_row;
    const DotF32TileFn dot_tile = dot_f32_tile_kernel(isa);
    const size_t row_floats_bytes = static_cast<size_t>(w.n_cols) * sizeof(float);
    const int64_t tile_rows = std::max<int64_t>(1, static_cast<int64_t>(kTileBytes / row_floats_bytes));
    const int64_t token_block =
        std::max<int64_t>(kMinTokenBlock, static_cast<int64_t>(kTokenBlockBytes / row_floats_bytes));
    pool.parallel_for_bytes(w.n_rows, weight_bytes * n_tokens, [&](int64_t begin, int64_t end, int) {
        thread_local std::vector<float> scratch;
        const size_t need =
            static_cast<size_t>(std::min(tile_rows, end - begin)) * static_cast<size_t>(w.n_cols);
        if (scratch.size() < need) scratch.resize(need);
        for (int64_t t0 = 0; t0 < n_tokens; t0 += token_block) {
            const int64_t t1 = std::min(n_tokens, t0 + token_block);
            for (int64_t r0 = begin; r0 < end; r0 += tile_rows) {
                const int64_t r1 = std::min(end, r0 + tile_rows);
                for (int64_t r = r0; r < r1; ++r) {
                    dequant_row(w.data + static_cast<size_t>(r) * w.row_bytes,
                                scratch.data() + (r - r0) * w.n_cols, w.n_cols);
                }
                // Bit-identical to dot_f32 per (row, token), hence to dot_row (kernels.h).
                dot_tile(scratch.data(), w.n_cols, r1 - r0, x + t0 * ldx, ldx, t1 - t0, w.n_cols,
                         y + t0 * ldy + r0, ldy);
            }
        }
    });
}

const QuantDotKernels* fast_dot_kernels(GgmlType type, bool exact) {
    return fast_kernels(type, active_isa(), exact);
}

void quantized_rows(const WeightView& w, const QuantDotKernels& kernels, const uint8_t* xq, size_t xq_bytes,
                    int64_t n_tokens, int64_t r0, int64_t r1, float* y, int64_t ldy) {
    // Blocked so that one tile of quantized tokens stays in L1 while a block of weight rows
    // (kQuantRowBlockBytes) streams from L2, rather than every row re-reading all the tokens'
    // activations. Each (row, token) is still one vec_dot_tile call on the same token tile.
    const VecDotTileFn tile = kernels.vec_dot_tile;
    const int64_t row_block =
        std::max<int64_t>(1, static_cast<int64_t>(kQuantRowBlockBytes / std::max<size_t>(1, w.row_bytes)));
    // AMX (qdot.h): the tokens in tiles of kAmxTokens, packed once per tile for all the rows; a
    // last tile of fewer than kAmxMinTokens tokens goes through vec_dot_tile (the same bits).
    const AmxKernels* amx = n_tokens >= kAmxMinTokens ? amx_kernels(w.type, active_isa()) : nullptr;
    int64_t amx_tokens = 0;
    if (amx != nullptr) {
        amx_tokens = n_tokens / kAmxTokens * kAmxTokens;
        if (n_tokens - amx_tokens >= kAmxMinTokens) amx_tokens = n_tokens;
        // Up to kAmxChunkTiles tiles (128 tokens) packed at a time: the rows' unpacked quants are
        // shared by that many tokens while the packed activations stay a few MiB at most.
        constexpr int64_t kAmxChunkTiles = 8;
        thread_local std::vector<uint8_t> packed;
        const size_t tile_bytes = amx->packed_bytes(w.n_cols);
        if (packed.size() < tile_bytes * kAmxChunkTiles) packed.resize(tile_bytes * kAmxChunkTiles);
        for (int64_t c0 = 0; c0 < amx_tokens; c0 += kAmxChunkTiles * kAmxTokens) {
            const int64_t c1 = std::min(amx_tokens, c0 + kAmxChunkTiles * kAmxTokens);
            for (int64_t t0 = c0; t0 < c1; t0 += kAmxTokens) {
                const int nt = static_cast<int>(std::min<int64_t>(kAmxTokens, c1 - t0));
                amx->pack(xq + static_cast<size_t>(t0) * xq_bytes, xq_bytes, nt, w.n_cols,
                          packed.data() + static_cast<size_t>((t0 - c0) / kAmxTokens) * tile_bytes);
            }
            for (int64_t r = r0; r < r1; r += kAmxRows) {
                const int nr = static_cast<int>(std::min<int64_t>(kAmxRows, r1 - r));
                amx->gemm(w.data + static_cast<size_t>(r) * w.row_bytes, w.row_bytes, nr, packed.data(),
                          c1 - c0, w.n_cols, y + c0 * ldy + r, ldy);
            }
        }
    }
    for (int64_t b0 = r0; b0 < r1; b0 += row_block) {
        const int64_t b1 = std::min(r1, b0 + row_block);
        for (int64_t t0 = amx_tokens; t0 < n_tokens; t0 += kMaxTileTokens) {
            const int nt = static_cast<int>(std::min<int64_t>(kMaxTileTokens, n_tokens - t0));
            const uint8_t* xt = xq + static_cast<size_t>(t0) * xq_bytes;
            for (int64_t r = b0; r < b1; ++r) {
                tile(w.data + static_cast<size_t>(r) * w.row_bytes, xt, xq_bytes, nt, w.n_cols,
                     y + t0 * ldy + r, ldy);
            }
        }
    }
}

void PreparedRow::reset(const float* x, int64_t n, bool exact) {
    x_ = x;
    n_ = n;
    exact_ = exact;
    for (bool& r : ready_) r = false;
}

RowDot PreparedRow::bind(GgmlType type) {
    const Isa isa = active_isa();
    RowDot d;
    d.n = n_;
    d.x = x_;
    d.f32_dot = row_kernels(type, isa).dot_row;  // UnsupportedError names the type
    const int64_t block = ggml_type_traits(type).block_size;
    if (block > 0 && n_ % block != 0) {
        throw InvalidArgument(std::string("[matmul] ") + ggml_type_traits(type).name + " row of " +
                              std::to_string(n_) + " elements: not a multiple of the block size " +
                              std::to_string(block));
    }
    const QuantDotKernels* qk = fast_kernels(type, isa, exact_);
    if (qk == nullptr) return d;
    const ActFormat format = act_format(type);
    const int f = static_cast<int>(format);
    if (!ready_[f]) {
        quantized_[f].resize(act_row_bytes(format, n_));
        quantize_act_kernel(format, isa)(x_, quantized_[f].data(), n_);
        ready_[f] = true;
    }
    d.q_dot = qk->vec_dot;
    d.xq = quantized_[f].data();
    return d;
}

}  // namespace sharpi::cpu
