// Where compute gets routed-expert weights from. The MoE FFN (moe/moe_ffn.cpp) reaches expert
// bytes only through this interface: ResidentExperts hands out views into the mapped file; the
// streaming cache (moe/expert_cache.h) hands out views into its slots. Architecture code never
// changes.
//
// Protocol, per MoE layer and step, on the decode thread: gate_fired(il, ids) once the router has
// chosen, then acquire(il, ids) with the unique experts the gate selected (it starts every missing
// read and returns at once), then for each expert i: wait(i) before touching views[i] (ready(i)
// says whether that would block), compute, and finally release(il). Views stay valid until
// release(il). At most max_acquire() experts may be held at once; callers with more (prefill
// batches) acquire in waves.
#pragma once

#include <cstdint>

#include "backend/op_types.h"
#include "moe/expert_layout.h"

namespace sharpi {

// One expert's three matrices: gate and up [n_ff_exp, n_embd], down [n_embd, n_ff_exp].
struct ExpertView {
    WeightView gate, up, down;
};

class ExpertSource {
  public:
    virtual ~ExpertSource() = default;
    // Fills views[i] for experts[i] (unique ids of layer il) and starts loading what is missing.
    virtual void acquire(int il, const int32_t* experts, int n, ExpertView* views) = 0;
    // Index i refers to the last acquire's list. wait(i) throws IoError if the read failed.
    virtual bool ready(int i) { return true; }
    virtual void wait(int i) {}
    virtual void release(int il) = 0;
    virtual int max_acquire() const { return 1 << 30; }
    // Layer il's gate selected `selected` (unique ids), before acquire: lets a cache drop
    // prefetched experts nobody chose.
    virtual void gate_fired(int il, const int32_t* selected, int n) {}
    // Prefill read-ahead: experts of a later layer il that a batch will probably select, given while
    // an earlier layer's experts are acquired (pinned), so their reads overlap that layer's compute.
    // Best effort: a cache may read some, all or none of them.
    virtual void read_ahead(int il, const int32_t* experts, int n) {}
};

// Every expert resident in the file mapping: acquire is pointer arithmetic, release is a no-op.
class ResidentExperts final : public ExpertSource {
  public:
    explicit ResidentExperts(const ExpertLayout& layout) : layout_(layout) {}
    void acquire(int il, const int32_t* experts, int n, ExpertView* views) override {
        const ExpertLayerLayout& x = layout_.layers[static_cast<size_t>(il)];
        for (int i = 0; i < n; ++i) {
            views[i].up = x.parts[kExpertUp].mapped(experts[i]);
            views[i].gate = x.gated() ? x.parts[kExpertGate].mapped(experts[i]) : views[i].up;
            views[i].down = x.parts[kExpertDown].mapped(experts[i]);
        }
    }
    void release(int) override {}

  private:
    const ExpertLayout& layout_;
};

}  // namespace sharpi
