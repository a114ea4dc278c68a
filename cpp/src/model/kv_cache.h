// Per-session sequence state and activation memory of the forward pass: the KV cache and the
// scratch arena the layer builders allocate activations from. Both are owned by the engine and
// outlive every Forward; neither does any computation.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

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

// f32 K and V for every layer: [n_layer][n_ctx, n_embd_kv]. Pages are touched only when written.
// Positions at or beyond the engine's n_past are never read, so a failed decode needs no undo.
// with_v = false (MLA): only k(il) exists, holding each position's latent; v(il) is nullptr.
class KvCache {
  public:
    KvCache(int64_t n_layer, int64_t n_ctx, int64_t n_embd_kv, bool with_v = true);
    float* k(int il) { return k_[static_cast<size_t>(il)].get(); }
    float* v(int il) { return v_[static_cast<size_t>(il)].get(); }
    int64_t n_ctx() const { return n_ctx_; }
    int64_t row_width() const { return n_embd_kv_; }

  private:
    int64_t n_ctx_, n_embd_kv_;
    std::vector<std::unique_ptr<float[]>> k_, v_;
};

}  // namespace sharpi
