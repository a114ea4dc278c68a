// Where compute gets routed-expert weights from. The forward pass reaches expert bytes only
// through this interface: ResidentExperts hands out views into the mapped file; the streaming
// cache (a separate component) hands out views into its slots. Architecture code never changes.
//
// Protocol, per MoE layer and step, on the decode thread: acquire(il, ids) once with the unique
// experts the gate selected (it starts every missing read and returns at once), then for each
// expert i: wait(i) before touching views[i] (ready(i) says whether that would block), compute,
// and finally release(il). Views stay valid until release(il). At most max_acquire() experts may
// be held at once; callers with more (prefill batches) acquire in waves.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/ops/matmul.h"
#include "model/model.h"

namespace sharpi {

// One expert's three matrices: gate and up [n_ff_exp, n_embd], down [n_embd, n_ff_exp].
struct ExpertView {
    cpu::WeightView gate, up, down;
};

// The rows of expert e inside a stacked tensor view (expert-major layout).
inline cpu::WeightView expert_slice(const cpu::WeightView& stacked, int64_t n_expert, int64_t e) {
    cpu::WeightView w = stacked;
    w.n_rows = stacked.n_rows / n_expert;
    w.data = stacked.data + static_cast<size_t>(e) * static_cast<size_t>(w.n_rows) * w.row_bytes;
    return w;
}

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
};

// Every expert resident in the file mapping: acquire is pointer arithmetic, release is a no-op.
class ResidentExperts final : public ExpertSource {
  public:
    explicit ResidentExperts(const Model& model) : model_(model) {}
    void acquire(int il, const int32_t* experts, int n, ExpertView* views) override {
        const StackedExperts& x = model_.layers[static_cast<size_t>(il)].experts;
        const int64_t n_expert = model_.hp.n_expert;
        for (int i = 0; i < n; ++i) {
            views[i].gate = expert_slice(x.gate, n_expert, experts[i]);
            views[i].up = expert_slice(x.up, n_expert, experts[i]);
            views[i].down = expert_slice(x.down, n_expert, experts[i]);
        }
    }
    void release(int) override {}

  private:
    const Model& model_;
};

}  // namespace sharpi
