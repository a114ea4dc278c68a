#include "tier_plan.h"

#include <algorithm>
#include <cstdio>
#include <numeric>

#include "backend/cuda_interface.h"
#include "memory_plan.h"
#include "model/model.h"
#include "moe/expert_cache.h"
#include "sharpi/errors.h"

namespace sharpi {

namespace {

constexpr uint64_t kMiB = 1ull << 20;

std::string mib(uint64_t bytes) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / static_cast<double>(kMiB));
    return buf;
}

// The MoE layers' experts, hottest first by the prior (ties: lower layer, then lower expert id, so
// the plan is the same on every run), keeping only experts the prior saw used.
std::vector<ExpertKey> hottest(const TierSizes& s, const std::vector<float>& prior) {
    std::vector<ExpertKey> keys;
    for (int64_t il = 0; il < s.n_layer; ++il) {
        if (s.expert_bytes[static_cast<size_t>(il)] == 0) continue;
        for (int64_t e = 0; e < s.n_expert; ++e) {
            if (prior[static_cast<size_t>(il * s.n_expert + e)] > 0.0f)
                keys.push_back(ExpertKey{static_cast<int32_t>(il), static_cast<int32_t>(e)});
        }
    }
    auto use = [&](const ExpertKey& k) {
        return prior[static_cast<size_t>(k.layer * s.n_expert + k.expert)];
    };
    std::stable_sort(keys.begin(), keys.end(),
                     [&](const ExpertKey& a, const ExpertKey& b) { return use(a) > use(b); });
    return keys;
}

}  // namespace

uint64_t TierSizes::expert_total_bytes() const {
    return std::accumulate(expert_bytes.begin(), expert_bytes.end(), uint64_t{0}) *
           static_cast<uint64_t>(n_expert);
}

TierPlan plan_tiers(const TierSizes& s, const TierRequest& r) {
    if (s.vram_slot_bytes == 0 || s.host_slot_bytes == 0)
        throw InvalidArgument("[plan] slot sizes must be > 0");
    if (static_cast<int64_t>(s.expert_bytes.size()) != s.n_layer)
        throw InvalidArgument("[plan] expert_bytes has " + std::to_string(s.expert_bytes.size()) +
                              " layers, expected " + std::to_string(s.n_layer));
    if (!(r.pin_share >= 0.0 && r.pin_share <= 1.0))
        throw InvalidArgument("[plan] pin share must be in [0, 1], got " + std::to_string(r.pin_share));
    if (!r.prior.empty() && static_cast<int64_t>(r.prior.size()) != s.n_layer * s.n_expert) {
        throw InvalidArgument("[plan] the prior has " + std::to_string(r.prior.size()) +
                              " entries, the model " + std::to_string(s.n_layer) + " layers x " +
                              std::to_string(s.n_expert) + " experts");
    }
    TierPlan p;
    p.vram_budget = r.vram_budget;
    p.ram_budget = r.ram_budget;
    p.device_dense_bytes = s.device_dense_bytes;
    p.device_kv_bytes = s.device_kv_bytes;
    p.device_buffer_bytes = s.device_buffer_bytes;
    p.vram_slot_bytes = s.vram_slot_bytes;
    p.host_slot_bytes = s.host_slot_bytes;
    p.host_fixed_bytes = s.host_fixed_bytes;
    p.n_experts_total = static_cast<uint64_t>(s.n_moe_layer * s.n_expert);
    const uint64_t k = static_cast<uint64_t>(s.n_expert_used);

    // VRAM: the fixed part, then top-k slots (+ staging) at the least.
    const uint64_t vram_fixed = s.device_dense_bytes + s.device_kv_bytes + s.device_buffer_bytes;
    p.vram_minimum_bytes = vram_fixed + (k + r.n_staging) * p.vram_slot_bytes;
    if (r.vram_budget < p.vram_minimum_bytes) {
        throw InvalidArgument("[plan] --vram-budget " + mib(r.vram_budget) + " is below the minimum " +
                              mib(p.vram_minimum_bytes) + ": dense weights " + mib(s.device_dense_bytes) +
                              " + KV cache " + mib(s.device_kv_bytes) + " + buffers " +
                              mib(s.device_buffer_bytes) + " + " + std::to_string(k) + " expert slots (+" +
                              std::to_string(r.n_staging) + " staging) of " + mib(p.vram_slot_bytes));
    }
    const uint64_t vram_left = r.vram_budget - vram_fixed;
    if (vram_left >= s.expert_total_bytes()) {
        // Every expert fits: upload them all (the part-1 forward pass); RAM holds no experts afterwards.
        p.experts_resident = true;
        p.vram_expert_bytes = s.expert_total_bytes();
        p.ram_holds_all = true;
        p.ram_minimum_bytes = r.ram_budget > 0 ? s.host_fixed_bytes : 0;
        if (r.ram_budget > 0 && r.ram_budget < s.host_fixed_bytes) {
            throw InvalidArgument("[plan] --ram-budget " + mib(r.ram_budget) + " is below the host buffers " +
                                  mib(s.host_fixed_bytes));
        }
        return p;
    }
    // Slots: at most one per expert; the slot count is below the expert count here, since the slot is
    // the largest expert and the experts do not all fit.
    const uint64_t capacity = vram_left / p.vram_slot_bytes - r.n_staging;  // >= k by the minimum
    uint64_t n_pinned = 0;
    if (!r.prior.empty()) {
        const std::vector<ExpertKey> hot = hottest(s, r.prior);
        n_pinned = std::min<uint64_t>(static_cast<uint64_t>(r.pin_share * static_cast<double>(capacity - k)),
                                      hot.size());
        p.vram_pinned.assign(hot.begin(), hot.begin() + static_cast<std::ptrdiff_t>(n_pinned));
    }
    p.n_vram_slots = std::min(capacity - n_pinned, p.n_experts_total - n_pinned);
    p.n_vram_staging = r.n_staging;
    p.vram_expert_bytes = (n_pinned + p.n_vram_slots + p.n_vram_staging) * p.vram_slot_bytes;

    // RAM: every expert VRAM does not pin has its home here or on disk.
    const uint64_t unpinned = p.n_experts_total - n_pinned;
    uint64_t unpinned_bytes = s.expert_total_bytes();
    for (const ExpertKey& key : p.vram_pinned)
        unpinned_bytes -= s.expert_bytes[static_cast<size_t>(key.layer)];
    if (r.ram_budget == 0) {
        p.ram_holds_all = true;  // the mapped file, pinned for the copy stream
        p.ram_expert_bytes = unpinned_bytes;
        return p;
    }
    p.ram_minimum_bytes = s.host_fixed_bytes + k * s.host_slot_bytes;
    if (r.ram_budget < p.ram_minimum_bytes) {
        throw InvalidArgument("[plan] --ram-budget " + mib(r.ram_budget) + " is below the minimum " +
                              mib(p.ram_minimum_bytes) + ": host buffers " + mib(s.host_fixed_bytes) + " + " +
                              std::to_string(k) + " expert slots of " + mib(s.host_slot_bytes));
    }
    p.n_ram_slots = std::min((r.ram_budget - s.host_fixed_bytes) / s.host_slot_bytes, unpinned);
    p.ram_holds_all = p.n_ram_slots == unpinned;
    p.ram_expert_bytes = p.n_ram_slots * s.host_slot_bytes;
    p.n_experts_on_disk_only = unpinned - p.n_ram_slots;
    return p;
}

std::string TierPlan::describe() const {
    std::string out = "VRAM " + mib(vram_bytes()) + " of " + mib(vram_budget) + ": dense weights " +
                      mib(device_dense_bytes) + " + KV cache " + mib(device_kv_bytes) + " + buffers " +
                      mib(device_buffer_bytes) + " + ";
    if (experts_resident) {
        out += "every expert (" + std::to_string(n_experts_total) + ", " + mib(vram_expert_bytes) +
               ") resident\n";
    } else {
        out += std::to_string(vram_pinned.size()) + " pinned hottest experts + " +
               std::to_string(n_vram_slots) + " expert slots + " + std::to_string(n_vram_staging) +
               " staging slots of " + mib(vram_slot_bytes) + " (minimum " + mib(vram_minimum_bytes) + ")\n";
    }
    out += "RAM: ";
    if (experts_resident) {
        out += "no experts after upload";
    } else if (ram_budget == 0) {
        out += "every expert VRAM does not pin (" + mib(ram_expert_bytes) + ", the file mapped and pinned)";
    } else {
        out += mib(host_fixed_bytes + ram_expert_bytes) + " of " + mib(ram_budget) + ": host buffers " +
               mib(host_fixed_bytes) + " + " + std::to_string(n_ram_slots) + " expert slots of " +
               mib(host_slot_bytes) + (ram_holds_all ? " (every unpinned expert)" : "");
    }
    out += "\ndisk: ";
    out += n_experts_on_disk_only == 0
               ? std::string("nothing read after load")
               : std::to_string(n_experts_on_disk_only) + " of " + std::to_string(n_experts_total) +
                     " experts beyond what RAM holds at once, read on demand";
    return out;
}

TierSizes tier_sizes(const Model& model, int64_t n_ctx, int64_t max_batch, GgmlType type_k, GgmlType type_v) {
    const cuda::DevicePlan device = cuda::plan_device_model(model, n_ctx, max_batch, type_k, type_v);
    MemoryPlanRequest request;
    request.n_ctx = n_ctx;
    request.type_k = type_k;
    request.type_v = type_v;
    request.max_batch = max_batch;
    const MemoryPlan host = plan_memory(model, request);
    const HParams& h = model.hp;
    TierSizes s;
    s.n_layer = h.n_layer;
    s.n_expert = h.n_expert;
    s.n_expert_used = h.n_expert_used;
    for (int il = 0; il < h.n_layer; ++il) {
        const bool moe = model.experts.layers[static_cast<size_t>(il)].present();
        s.expert_bytes.push_back(moe ? model.experts.expert_bytes(il) : 0);
        s.n_moe_layer += moe ? 1 : 0;
    }
    s.host_slot_bytes = host.slot_bytes;
    s.vram_slot_bytes = host.slot_bytes;
    s.device_dense_bytes = device.dense_bytes;
    s.device_kv_bytes = device.kv_bytes;
    s.device_buffer_bytes = device.buffer_bytes;
    s.host_fixed_bytes = host.buffer_bytes;
    return s;
}

AutoVramBudget auto_vram_budget(uint64_t vram_free) {
    AutoVramBudget a;
    a.free = vram_free;
    a.margin = std::max<uint64_t>(512 * kMiB, vram_free / 20);
    if (vram_free <= a.margin) {
        throw InvalidArgument("[plan] --vram-budget auto: " + mib(vram_free) +
                              " free VRAM leaves nothing above the " + mib(a.margin) + " margin");
    }
    a.budget = vram_free - a.margin;
    return a;
}

std::string AutoVramBudget::describe() const {
    return "--vram-budget auto: " + mib(budget) + " = " + mib(free) + " free - margin " + mib(margin);
}

}  // namespace sharpi
