#include "model/kv_cache.h"

#include <algorithm>

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

KvCache::KvCache(int64_t n_layer, int64_t n_ctx, int64_t n_embd_kv, bool with_v)
    : n_ctx_(n_ctx), n_embd_kv_(n_embd_kv) {
    for (int64_t il = 0; il < n_layer; ++il) {
        // new float[] without () leaves the memory untouched: pages are faulted in as positions fill.
        k_.emplace_back(new float[static_cast<size_t>(n_ctx * n_embd_kv)]);
        v_.emplace_back(with_v ? new float[static_cast<size_t>(n_ctx * n_embd_kv)] : nullptr);
    }
}

}  // namespace sharpi
