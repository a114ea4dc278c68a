#include "model/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "cpu/quant/kernels.h"
#include "cpu/quant/qdot.h"
#include "quant/blocks.h"
#include "quant/fp16.h"
#include "sharpi/errors.h"

namespace sharpi {

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

GgmlType parse_kv_type(const std::string& name) {
    for (GgmlType t : {GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0}) {
        if (name == ggml_type_traits(t).name) return t;
    }
    throw InvalidArgument("[kv] unknown cache type '" + name + "': expected f32, f16, q8_0 or q4_0");
}

GgmlType kv_type_for(const std::string& requested, bool exact) {
    if (!requested.empty()) return parse_kv_type(requested);
    return exact ? GgmlType::F32 : GgmlType::F16;
}

namespace {

// llama.cpp's quantize_row_q4_0_ref, step for step (f32 arithmetic).
void quantize_q4_0(const float* x, block_q4_0* y, int64_t n) {
    constexpr int qk = QK4_0;
    for (int64_t ib = 0; ib < n / qk; ++ib, x += qk) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < qk; ++j) {
            if (amax < std::fabs(x[j])) {
                amax = std::fabs(x[j]);
                max = x[j];
            }
        }
        const float d = max / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[ib].d = fp32_to_fp16(d);
        for (int j = 0; j < qk / 2; ++j) {
            const float x0 = x[j] * id, x1 = x[qk / 2 + j] * id;
            const uint8_t q0 = static_cast<uint8_t>(std::min<int>(15, static_cast<int8_t>(x0 + 8.5f)));
            const uint8_t q1 = static_cast<uint8_t>(std::min<int>(15, static_cast<int8_t>(x1 + 8.5f)));
            y[ib].qs[j] = static_cast<uint8_t>(q0 | (q1 << 4));
        }
    }
}

}  // namespace

void kv_store_row(GgmlType type, const float* x, void* dst, int64_t n) {
    switch (type) {
        case GgmlType::F32:
            std::memcpy(dst, x, sizeof(float) * static_cast<size_t>(n));
            return;
        case GgmlType::F16: {
            uint16_t* h = static_cast<uint16_t*>(dst);
            for (int64_t i = 0; i < n; ++i) h[i] = fp32_to_fp16(x[i]);
            return;
        }
        case GgmlType::Q8_0:
            // Same bits on every ISA (qdot.h), so the stored cache does not depend on the CPU.
            cpu::quantize_act_kernel(cpu::ActFormat::q8_0, cpu::active_isa())(x, dst, n);
            return;
        case GgmlType::Q4_0:
            quantize_q4_0(x, static_cast<block_q4_0*>(dst), n);
            return;
        default:
            break;
    }
    throw UnsupportedError(std::string("[kv] cannot store the KV cache as ") + ggml_type_traits(type).name);
}

KvCache::KvCache(int64_t n_layer, int64_t n_ctx, int64_t n_embd_kv, int64_t head_dim, GgmlType type_k,
                 GgmlType type_v, bool with_v)
    : n_ctx_(n_ctx),
      n_embd_kv_(n_embd_kv),
      type_k_(type_k),
      type_v_(type_v),
      row_bytes_k_(ggml_row_size(type_k, n_embd_kv)),
      row_bytes_v_(ggml_row_size(type_v, n_embd_kv)) {
    for (GgmlType t : {type_k, type_v}) {
        const int64_t block = ggml_type_traits(t).block_size;
        if (head_dim % block != 0) {
            throw UnsupportedError(std::string("[kv] cache type ") + ggml_type_traits(t).name +
                                   " needs head_dim to be a multiple of " + std::to_string(block) +
                                   "; this model's head_dim is " + std::to_string(head_dim) +
                                   (with_v ? "" : " (the MLA latent row, kv_lora_rank + n_rot)") +
                                   " (use f16 or f32)");
        }
    }
    for (int64_t il = 0; il < n_layer; ++il) {
        // new[] without () leaves the memory untouched: pages are faulted in as positions fill.
        k_.emplace_back(new uint8_t[static_cast<size_t>(n_ctx) * row_bytes_k_]);
        v_.emplace_back(with_v ? new uint8_t[static_cast<size_t>(n_ctx) * row_bytes_v_] : nullptr);
    }
}

uint64_t KvCache::bytes(int64_t n_layer, int64_t n_ctx, int64_t n_embd_kv, GgmlType type_k, GgmlType type_v,
                        bool with_v) {
    return static_cast<uint64_t>(n_layer) * static_cast<uint64_t>(n_ctx) *
           (ggml_row_size(type_k, n_embd_kv) + (with_v ? ggml_row_size(type_v, n_embd_kv) : 0));
}

KvLayout kv_layout(const HParams& h, GgmlType type_k, GgmlType type_v) {
    KvLayout l;
    for (int il = 0; il < h.n_layer; ++il) l.n_layer_written += h.has_kv(il) ? 1 : 0;
    if (!h.compress_ratios.empty()) {
        // deepseek4: one f32 row per position holding every per-position piece of the layer's state
        // (HParams::dsv4_kv_row); rounding the compressor's raw rows would change what they emit, so
        // only f32 is accepted.
        for (int il = 0; il < h.n_layer; ++il) l.width = std::max(l.width, h.dsv4_kv_row(il));
        l.head_dim = l.width;
        if (type_k != GgmlType::F32 || type_v != GgmlType::F32) {
            throw InvalidArgument(
                std::string("[kv] deepseek4 keeps its sliding-window and compressor state in an "
                            "f32 cache row; cache_type_k / cache_type_v must be f32, got K ") +
                ggml_type_traits(type_k).name + ", V " + ggml_type_traits(type_v).name);
        }
        l.type_k = l.type_v = GgmlType::F32;
        l.with_v = false;
        return l;
    }
    if (h.is_mla()) {
        l.width = h.kv_floats_per_token();
        // A quantized row is read in parts (the latent with its RoPE key, then the DSA indexer's
        // key), so each part must be whole blocks: checking their gcd checks both.
        l.head_dim = h.has_indexer() ? std::gcd(h.n_lora_kv + h.rope.n_rot, h.indexer_head_dim) : l.width;
        if (type_k != type_v) {
            throw InvalidArgument(
                std::string("[kv] multi-head latent attention caches one latent row per position that is "
                            "both K and V "
                            "(deepseek2, deepseek32; llama.cpp's V is a view of its K cache), "
                            "so cache_type_k and cache_type_v must be the same type: got K ") +
                ggml_type_traits(type_k).name + ", V " + ggml_type_traits(type_v).name);
        }
        l.type_k = l.type_v = type_k;
        l.with_v = false;
        return l;
    }
    l.width = h.n_embd_kv();
    l.head_dim = h.head_dim;
    l.type_k = type_k;
    l.type_v = type_v;
    return l;
}

void KvCache::store_k(int il, int64_t pos, const float* k_row) {
    kv_store_row(type_k_, k_row, k_[static_cast<size_t>(il)].get() + static_cast<size_t>(pos) * row_bytes_k_,
                 n_embd_kv_);
}

void KvCache::store(int il, int64_t pos, const float* k_row, const float* v_row) {
    store_k(il, pos, k_row);
    kv_store_row(type_v_, v_row, v_[static_cast<size_t>(il)].get() + static_cast<size_t>(pos) * row_bytes_v_,
                 n_embd_kv_);
}

void KvCache::copy_prefix(const KvCache& src, int64_t n, const std::vector<bool>& layers) {
    if (src.n_ctx_ != n_ctx_ || src.n_embd_kv_ != n_embd_kv_ || src.type_k_ != type_k_ ||
        src.type_v_ != type_v_ || src.k_.size() != k_.size() || n < 0 || n > n_ctx_) {
        throw InvalidArgument("[kv] copy_prefix: the caches differ in shape or " + std::to_string(n) +
                              " positions do not fit");
    }
    for (size_t il = 0; il < k_.size() && il < layers.size(); ++il) {
        if (!layers[il]) continue;
        std::memcpy(k_[il].get(), src.k_[il].get(), static_cast<size_t>(n) * row_bytes_k_);
        if (v_[il]) std::memcpy(v_[il].get(), src.v_[il].get(), static_cast<size_t>(n) * row_bytes_v_);
    }
}

}  // namespace sharpi
