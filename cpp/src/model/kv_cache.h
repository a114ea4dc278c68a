// Per-session sequence state and activation memory of the forward pass: the KV cache and the
// scratch arena the layer builders allocate activations from. Both are owned by the engine and
// outlive every Forward; neither does any computation beyond rounding a K/V row to its stored type.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/hparams.h"
#include "quant/ggml_type.h"

namespace sharpi {

// An activation: [n_tokens, width] f32 rows, usually in a Scratch arena (valid until its reset()).
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

// Element types a K or V row may be stored in, by the names llama.cpp's --cache-type-k/-v use:
// "f32", "f16", "q8_0", "q4_0". Throws InvalidArgument naming the accepted ones.
GgmlType parse_kv_type(const std::string& name);
// The type a session stores K (or V) in: `requested` when not empty, else f32 in exact mode (the
// oracle tests' arithmetic, bit for bit as before KV types existed) and f16 in fast mode.
GgmlType kv_type_for(const std::string& requested, bool exact);

// Rounds one row of n f32 values to `type` exactly as the KV cache stores it:
//   f32: copy; f16: round to nearest even; q8_0: blocks of 32 with d = amax / 127 (f16) and
//   qs = round-half-even(x * 127 / amax) (the fast-mode activation quantizer, cpu/quant/qdot.h);
//   q4_0: llama.cpp's reference quantize_row_q4_0 (d = signed absmax / -8, q = min(15, trunc(x / d + 8.5))).
// n must be a multiple of the type's block size.
void kv_store_row(GgmlType type, const float* x, void* dst, int64_t n);

// The KV cache a model needs. MLA (deepseek2) keeps one row per position holding the latent and the
// RoPE key (kv_lora_rank + n_rot elements) in type_k, and no V; deepseek32 appends the DSA indexer's
// key (indexer.key_length elements) to the same row, so it follows every truncation, fork and prefix
// copy of the latent and the budget charges it with the KV (llama.cpp keeps it in a second cache of
// the same type_k): as in llama.cpp, whose V for MLA is a
// view of the K cache, the latent is both, so a type_v different from type_k is refused
// (InvalidArgument; llama.cpp refuses it too) rather than silently ignored. Hybrid archs (qwen3next,
// qwen35moe) write only their attention layers: the recurrent layers' rows are allocated untouched (no pages)
// and not charged.
struct KvLayout {
    int64_t n_layer_written = 0;  // layers that store rows (what the budget charges)
    int64_t width = 0;            // elements per row
    int64_t head_dim = 0;         // block-size check for quantized types
    GgmlType type_k = GgmlType::F32, type_v = GgmlType::F32;
    bool with_v = true;
};
KvLayout kv_layout(const HParams& h, GgmlType type_k, GgmlType type_v);

// K and V of every layer: [n_layer][n_ctx] rows of n_embd_kv elements in type_k / type_v (a
// quantized row is its heads' blocks back to back, so head h is the bytes of elements
// [h * head_dim, (h + 1) * head_dim); head_dim must be a multiple of the block size). Pages are
// touched only when written. Positions at or beyond the engine's n_past are never read, so a
// failed decode needs no undo.
class KvCache {
  public:
    // with_v = false (MLA): only k(il) exists; v(il) is nullptr.
    KvCache(int64_t n_layer, int64_t n_ctx, int64_t n_embd_kv, int64_t head_dim, GgmlType type_k,
            GgmlType type_v, bool with_v = true);
    // The bytes such a cache allocates (what the budget planner charges).
    static uint64_t bytes(int64_t n_layer, int64_t n_ctx, int64_t n_embd_kv, GgmlType type_k, GgmlType type_v,
                          bool with_v = true);
    static uint64_t bytes(const KvLayout& layout, int64_t n_ctx) {
        return bytes(layout.n_layer_written, n_ctx, layout.width, layout.type_k, layout.type_v,
                     layout.with_v);
    }
    // Rounds and stores the K and V rows of position pos of layer il.
    void store(int il, int64_t pos, const float* k_row, const float* v_row);
    // Rounds and stores the K row only (MLA's latent row; with_v = false).
    void store_k(int il, int64_t pos, const float* k_row);
    // Copies positions [0, n) of the layers marked in `layers` from `src` (same shape and types):
    // a forked sequence starts from its parent's prefix. Other layers are left untouched (no pages).
    void copy_prefix(const KvCache& src, int64_t n, const std::vector<bool>& layers);
    const uint8_t* k(int il) const { return k_[static_cast<size_t>(il)].get(); }
    // Layer il's K rows for an op that writes them in place (deepseek4's compressed attention: f32
    // rows, written exactly as store_k would).
    uint8_t* k_mutable(int il) { return k_[static_cast<size_t>(il)].get(); }
    const uint8_t* v(int il) const { return v_[static_cast<size_t>(il)].get(); }
    GgmlType type_k() const { return type_k_; }
    GgmlType type_v() const { return type_v_; }
    size_t row_bytes_k() const { return row_bytes_k_; }
    size_t row_bytes_v() const { return row_bytes_v_; }
    int64_t n_ctx() const { return n_ctx_; }
    int64_t row_width() const { return n_embd_kv_; }

  private:
    int64_t n_ctx_, n_embd_kv_;
    GgmlType type_k_, type_v_;
    size_t row_bytes_k_, row_bytes_v_;
    std::vector<std::unique_ptr<uint8_t[]>> k_, v_;
};

}  // namespace sharpi
