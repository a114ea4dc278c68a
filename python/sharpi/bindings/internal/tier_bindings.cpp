// The tier planner (tier_plan.h), ram_budget "auto" (ram_budget.h) and the miss cost model
// (moe/miss_cost.h): host arithmetic, present in every build. Type conversion only.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "backend/cuda_interface.h"
#include "gguf/cache_prior_file.h"
#include "internal.h"
#include "model/model.h"
#include "moe/cpu_miss.h"
#include "moe/miss_cost.h"
#include "ram_budget.h"
#include "sharpi/errors.h"
#include "threads/thread_pool.h"
#include "tier_plan.h"

namespace py = pybind11;

namespace sharpi::py_bindings {
namespace {

using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;

py::dict sizes_dict(const TierSizes& s) {
    py::dict d;
    d["n_layer"] = s.n_layer;
    d["n_moe_layer"] = s.n_moe_layer;
    d["n_expert"] = s.n_expert;
    d["n_expert_used"] = s.n_expert_used;
    d["expert_bytes"] = s.expert_bytes;
    d["host_slot_bytes"] = s.host_slot_bytes;
    d["vram_slot_bytes"] = s.vram_slot_bytes;
    d["device_dense_bytes"] = s.device_dense_bytes;
    d["device_kv_bytes"] = s.device_kv_bytes;
    d["device_buffer_bytes"] = s.device_buffer_bytes;
    d["host_fixed_bytes"] = s.host_fixed_bytes;
    return d;
}

TierSizes sizes_from(const py::dict& d) {
    TierSizes s;
    s.n_layer = d["n_layer"].cast<int64_t>();
    s.n_moe_layer = d["n_moe_layer"].cast<int64_t>();
    s.n_expert = d["n_expert"].cast<int64_t>();
    s.n_expert_used = d["n_expert_used"].cast<int64_t>();
    s.expert_bytes = d["expert_bytes"].cast<std::vector<uint64_t>>();
    s.host_slot_bytes = d["host_slot_bytes"].cast<uint64_t>();
    s.vram_slot_bytes = d["vram_slot_bytes"].cast<uint64_t>();
    s.device_dense_bytes = d["device_dense_bytes"].cast<uint64_t>();
    s.device_kv_bytes = d["device_kv_bytes"].cast<uint64_t>();
    s.device_buffer_bytes = d["device_buffer_bytes"].cast<uint64_t>();
    s.host_fixed_bytes = d["host_fixed_bytes"].cast<uint64_t>();
    return s;
}

py::dict plan_dict(const TierPlan& p) {
    py::dict d;
    d["vram_budget"] = p.vram_budget;
    d["device_dense_bytes"] = p.device_dense_bytes;
    d["device_kv_bytes"] = p.device_kv_bytes;
    d["device_buffer_bytes"] = p.device_buffer_bytes;
    d["experts_resident"] = p.experts_resident;
    py::list pinned;
    for (const ExpertKey& k : p.vram_pinned) pinned.append(py::make_tuple(k.layer, k.expert));
    d["vram_pinned"] = pinned;
    d["vram_slot_bytes"] = p.vram_slot_bytes;
    d["n_vram_slots"] = p.n_vram_slots;
    d["n_vram_staging"] = p.n_vram_staging;
    d["vram_expert_bytes"] = p.vram_expert_bytes;
    d["vram_minimum_bytes"] = p.vram_minimum_bytes;
    d["vram_bytes"] = p.vram_bytes();
    d["ram_budget"] = p.ram_budget;
    d["host_fixed_bytes"] = p.host_fixed_bytes;
    d["ram_holds_all"] = p.ram_holds_all;
    d["n_ram_slots"] = p.n_ram_slots;
    d["host_slot_bytes"] = p.host_slot_bytes;
    d["ram_expert_bytes"] = p.ram_expert_bytes;
    d["ram_minimum_bytes"] = p.ram_minimum_bytes;
    d["n_experts_total"] = p.n_experts_total;
    d["n_experts_on_disk_only"] = p.n_experts_on_disk_only;
    d["summary"] = p.describe();
    return d;
}

TierRequest request_from(uint64_t vram_budget, uint64_t ram_budget, uint64_t n_staging, double pin_share) {
    TierRequest r;
    r.vram_budget = vram_budget;
    r.ram_budget = ram_budget;
    r.n_staging = n_staging;
    r.pin_share = pin_share;
    return r;
}

py::dict plan_sizes(const py::dict& sizes, uint64_t vram_budget, uint64_t ram_budget, uint64_t n_staging,
                    const std::optional<FloatArray>& prior, double pin_share) {
    TierRequest r = request_from(vram_budget, ram_budget, n_staging, pin_share);
    if (prior) r.prior.assign(prior->data(), prior->data() + prior->size());
    return plan_dict(plan_tiers(sizes_from(sizes), r));
}

// The plan of a model file for a device session of n_ctx positions (0: a Session's default) with a
// predictor of `lookahead` layers (0: none; staging = lookahead * top-k slots), the prior read from a
// cache prior file when prior_path is not empty.
py::dict plan_file(const std::string& path, uint64_t vram_budget, uint64_t ram_budget, int64_t n_ctx,
                   int64_t max_batch, int lookahead, const std::string& prior_path, double pin_share) {
    const std::unique_ptr<Model> model = load_model(path, /*streaming=*/false);
    const HParams& h = model->hp;
    if (n_ctx <= 0) n_ctx = std::min<int64_t>(h.n_ctx_train, 4096);
    const TierSizes s = tier_sizes(*model, n_ctx, max_batch, GgmlType::F32, GgmlType::F32);
    TierRequest r = request_from(
        vram_budget, ram_budget,
        static_cast<uint64_t>(std::max(0, lookahead)) * static_cast<uint64_t>(h.n_expert_used), pin_share);
    if (!prior_path.empty()) r.prior = read_cache_prior(prior_path, h.n_layer, h.n_expert);
    py::dict d = plan_dict(plan_tiers(s, r));
    d["sizes"] = sizes_dict(s);
    d["n_ctx"] = n_ctx;
    return d;
}

py::dict auto_budget(std::optional<uint64_t> vram_free) {
    if (!vram_free) {
        const cuda::DeviceInfo info = cuda::device_info();
        if (!info.present)
            throw DeviceError("[plan] --vram-budget auto needs a CUDA device: " + cuda::describe());
        vram_free = info.vram_free;
    }
    const AutoVramBudget a = auto_vram_budget(*vram_free);
    py::dict d;
    d["budget"] = a.budget;
    d["free"] = a.free;
    d["margin"] = a.margin;
    d["summary"] = a.describe();
    return d;
}

// ram_budget "auto" (ram_budget.h) read from the given files (the process's own by default).
py::dict ram_auto_budget(const std::string& proc_cgroup, const std::string& cgroup_root,
                         const std::string& meminfo) {
    const AutoRamBudget a = auto_ram_budget(MemoryProbePaths{proc_cgroup, cgroup_root, meminfo});
    py::dict d;
    d["budget"] = a.budget;
    d["available"] = a.available;
    d["margin"] = a.margin;
    d["source"] = a.source;
    d["summary"] = a.describe();
    return d;
}

py::object ram_cgroup_available(const std::string& proc_cgroup, const std::string& cgroup_root) {
    const std::optional<CgroupAvailable> c = cgroup_available(proc_cgroup, cgroup_root);
    if (!c) return py::none();
    return py::make_tuple(c->bytes, c->source);
}

py::dict miss_route(uint64_t expert_bytes, int64_t n_embd, int64_t n_tokens, double copy_bytes_per_s,
                    double copy_latency_s, double cpu_bytes_per_s) {
    const MissCost c = choose_miss_route(
        MissCostInputs{expert_bytes, n_embd, n_tokens, copy_bytes_per_s, copy_latency_s, cpu_bytes_per_s});
    py::dict d;
    d["route"] = miss_route_name(c.route);
    d["copy_s"] = c.copy_s;
    d["cpu_s"] = c.cpu_s;
    return d;
}

// route_misses on given inputs: a list of 'copy' | 'cpu', one per present flag.
std::vector<std::string> miss_routes(const std::string& mode, const std::vector<bool>& present,
                                     uint64_t expert_bytes, int64_t n_embd, int64_t n_tokens,
                                     double copy_bytes_per_s, double copy_latency_s, double cpu_bytes_per_s) {
    const std::vector<MissRoute> routes = route_misses(
        parse_miss_mode(mode), present,
        MissCostInputs{expert_bytes, n_embd, n_tokens, copy_bytes_per_s, copy_latency_s, cpu_bytes_per_s});
    std::vector<std::string> out;
    for (const MissRoute r : routes) out.emplace_back(miss_route_name(r));
    return out;
}

double cpu_expert_speed(const std::string& path, int threads, bool exact, int repeats) {
    const std::unique_ptr<Model> model = load_model(path, /*streaming=*/false);
    cpu::ThreadPool pool(std::max(1, threads));
    py::gil_scoped_release release;
    return measure_cpu_expert_speed(model->experts, model->hp.n_embd, pool, exact, repeats);
}

}  // namespace

void bind_tiers(py::module_& m) {
    m.def("tier_plan", &plan_sizes, py::arg("sizes"), py::arg("vram_budget"), py::arg("ram_budget") = 0,
          py::arg("n_staging") = 0, py::arg("prior") = py::none(), py::arg("pin_share") = 0.5,
          "The tier plan (tier_plan.h) of synthetic sizes (a dict with TierSizes' fields)");
    m.def("tier_plan_file", &plan_file, py::arg("path"), py::arg("vram_budget"), py::arg("ram_budget") = 0,
          py::arg("n_ctx") = 0, py::arg("max_batch") = 256, py::arg("lookahead") = 0,
          py::arg("prior_path") = "", py::arg("pin_share") = 0.5,
          "The tier plan of a model file: what VRAM pins and slots, what RAM holds, what stays on disk");
    m.def("vram_budget_auto", &auto_budget, py::arg("vram_free") = py::none(),
          "--vram-budget auto: free VRAM (device 0's, or the given bytes) minus the margin; DeviceError "
          "without a device");
    const MemoryProbePaths probe;
    m.def("ram_budget_auto", &ram_auto_budget, py::arg("proc_cgroup") = probe.proc_cgroup,
          py::arg("cgroup_root") = probe.cgroup_root, py::arg("meminfo") = probe.meminfo,
          "--ram-budget auto (ram_budget.h): dict(budget, available, margin, source, summary) from "
          "MemAvailable and the memory cgroups' limits; InvalidArgument when nothing is left");
    m.def("ram_cgroup_available", &ram_cgroup_available, py::arg("proc_cgroup") = probe.proc_cgroup,
          py::arg("cgroup_root") = probe.cgroup_root,
          "(bytes, description) of the tightest memory cgroup limit - usage, or None without a limit");
    m.attr("RAM_BUDGET_MARGIN_MIN") = kRamBudgetMarginMin;
    m.attr("RAM_BUDGET_MARGIN_FRACTION") = kRamBudgetMarginFraction;
    m.def("miss_route", &miss_route, py::arg("expert_bytes"), py::arg("n_embd"), py::arg("n_tokens"),
          py::arg("copy_bytes_per_s"), py::arg("copy_latency_s"), py::arg("cpu_bytes_per_s"),
          "The miss cost model (moe/miss_cost.h): dict(route='copy'|'cpu', copy_s, cpu_s)");
    m.def("miss_routes", &miss_routes, py::arg("mode"), py::arg("present"), py::arg("expert_bytes"),
          py::arg("n_embd"), py::arg("n_tokens"), py::arg("copy_bytes_per_s"), py::arg("copy_latency_s"),
          py::arg("cpu_bytes_per_s"),
          "moe/cpu_miss.h route_misses: the route of each selected expert ('copy' | 'cpu') under a mode "
          "('copy', 'cpu', 'auto'), given which are in VRAM");
    m.def("cpu_expert_speed", &cpu_expert_speed, py::arg("path"), py::arg("threads") = 1,
          py::arg("exact") = false, py::arg("repeats") = 5,
          "moe/cpu_miss.h measure_cpu_expert_speed: the CPU expert kernel's weight bytes per second on "
          "one row (the CPU half of the miss cost model's inputs)");
}

}  // namespace sharpi::py_bindings
