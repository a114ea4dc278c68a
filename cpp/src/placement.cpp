#include "placement.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "gguf/cache_prior_file.h"
#include "memory_plan.h"
#include "model/kv_cache.h"
#include "moe/prefetch_sizing.h"
#include "moe/replacement_policy.h"
#include "predict/predictor.h"
#include "ram_budget.h"
#include "sharpi/errors.h"
#include "tier_plan.h"

namespace sharpi {

namespace {

// Exact mode: SessionOptions::exact, or SHARPI_EXACT=1 in the environment when the session is made.
bool exact_mode(const SessionOptions& options) {
    const char* env = std::getenv("SHARPI_EXACT");
    return options.exact || (env != nullptr && std::strcmp(env, "1") == 0);
}

// SHARPI_CPU_MOE=1: CPU compute of every VRAM miss, whatever miss_route says.
bool cpu_moe_forced() {
    const char* env = std::getenv("SHARPI_CPU_MOE");
    return env != nullptr && std::string(env) == "1";
}

// SHARPI_READ_TIMEOUT_MS: how long compute waits for an expert read before IoError (default 60 s).
double read_timeout_ms() {
    const char* env = std::getenv("SHARPI_READ_TIMEOUT_MS");
    if (env == nullptr || *env == '\0') return 60000.0;
    char* end = nullptr;
    const double ms = std::strtod(env, &end);
    if (end == env || *end != '\0' || !(ms > 0.0)) {
        throw InvalidArgument(std::string("SHARPI_READ_TIMEOUT_MS: not a positive number of ms: '") + env +
                              "'");
    }
    return ms;
}

// A predictor reads up to top-k experts for each of the next `lookahead` layers into staging slots of
// their own (prefetch never evicts); none without a predictor.
uint64_t staging_slots(const SessionOptions& options, const HParams& h) {
    if (options.predictor == "none") return 0;
    return static_cast<uint64_t>(h.n_expert_used) * static_cast<uint64_t>(options.lookahead);
}

// The replacement policy options of either tier's cache.
void set_cache_policy(const SessionOptions& options, const HParams& h, ExpertCacheOptions& o) {
    o.probation = options.slru_probation;
    if (!options.cache_policy.empty()) o.policy = options.cache_policy;
    if (!options.cache_policy_file.empty() && o.policy != "prior") {
        throw InvalidArgument("[cache] policy '" + o.policy + "' reads no file (only 'prior' does)");
    }
    if (o.policy == "prior")
        o.policy_prior = read_cache_prior(options.cache_policy_file, h.n_layer, h.n_expert);
}

// device="cuda": options the device path does not take, refused before anything is allocated.
void check_device_options(const SessionOptions& options, const std::string& path) {
    const auto refuse = [&](const std::string& what) {
        throw UnsupportedError("[cuda] device=\"cuda\" for " + path + ": " + what +
                               " is not on the device path yet (use device=\"cpu\")");
    };
    if (options.ram_budget > 0) refuse("ram_budget (streaming experts to the device is part 2)");
    if (options.dump_activations) refuse("dump_activations");
    if (options.n_seq > 1) refuse("n_seq > 1 (batched sequences)");
}

// The RAM tier (docs/design.md §2): dense weights, KV cache and buffers are charged first; the rest
// becomes slots. Throws InvalidArgument naming the minimum budget.
void plan_ram_tier(const SessionOptions& options, uint64_t budget, const Model& model, int64_t max_batch,
                   Placement& p) {
    const HParams& h = model.hp;
    // The layers with routed experts (deepseek2's leading dense layers and llama4's interleaved
    // dense ones have none).
    int64_t n_moe_layer = 0;
    for (const ExpertLayerLayout& layer : model.experts.layers) n_moe_layer += layer.present() ? 1 : 0;
    const uint64_t total_experts = static_cast<uint64_t>(n_moe_layer * h.n_expert);
    MemoryPlanRequest request;
    request.n_ctx = p.n_ctx;
    request.n_seq = options.n_seq;
    request.max_draft_tokens = options.max_draft_tokens;
    request.mtp = options.mtp;
    request.mtp_file = options.mtp_file;
    request.type_k = p.type_k;
    request.type_v = p.type_v;
    request.max_batch = max_batch;
    request.n_staging = staging_slots(options, h);
    const MemoryPlan plan = plan_memory(model, request);
    if (budget < plan.minimum_bytes) {
        throw InvalidArgument("ram_budget " + std::to_string(budget) + " B is too small for " +
                              model.file->path() + ": " + plan.describe(p.n_ctx, p.type_k, p.type_v));
    }
    ExpertCacheOptions& o = p.ram_cache;
    o.n_slots =
        std::min<uint64_t>((budget - plan.fixed_bytes) / plan.slot_bytes - request.n_staging, total_experts);
    o.n_staging = request.n_staging;
    set_cache_policy(options, h, o);
    o.reader = options.reader;
    o.read_timeout_ms = read_timeout_ms();
    p.ram_streams = true;
    p.budget_bytes = budget;
    p.fixed_bytes = plan.fixed_bytes;
}

// device="cuda" with a vram_budget: the tier plan (InvalidArgument below its minimum, DeviceError for
// "auto" without a device). Streams the experts through the VRAM tier unless they all fit.
void plan_vram_tier(const SessionOptions& options, const Model& model, int64_t max_batch,
                    const MachineProbe& probe, Placement& p) {
    const HParams& h = model.hp;
    const std::string& path = model.file->path();
    if (!h.is_moe()) {
        throw InvalidArgument("vram_budget: " + path +
                              " is a dense model (no routed experts to stream; drop vram_budget)");
    }
    // The same sizes the device path charges (and its UnsupportedError for what it does not compute).
    const TierSizes sizes = tier_sizes(model, p.n_ctx, max_batch, p.device_type_k, p.device_type_v);
    TierRequest request;
    if (options.vram_budget == SessionOptions::kVramBudgetAuto) {
        const cuda::DeviceInfo info = probe.device_info();
        if (!info.present) throw DeviceError("vram_budget \"auto\" for " + path + ": " + cuda::describe());
        request.vram_budget = auto_vram_budget(info.vram_free).budget;
    } else {
        request.vram_budget = options.vram_budget;
    }
    request.n_staging = staging_slots(options, h);
    TierPlan plan;
    try {
        plan = plan_tiers(sizes, request);
    } catch (const InvalidArgument& e) {
        throw InvalidArgument("vram_budget for " + path + ": " + e.what());
    }
    if (plan.experts_resident) return;
    ExpertCacheOptions& o = p.vram_cache;
    o.n_slots = plan.n_vram_slots;
    o.n_staging = plan.n_vram_staging;
    set_cache_policy(options, h, o);
    o.reader = options.reader;  // the VRAM tier's fill source (cuda/device_tier.cuh)
    p.vram_streams = true;
    p.budget_bytes = request.vram_budget;
    p.fixed_bytes = plan.device_dense_bytes + plan.device_kv_bytes + plan.device_buffer_bytes;
}

}  // namespace

MachineProbe::MachineProbe()
    : ram_auto([] { return auto_ram_budget(); }), device_info([] { return cuda::device_info(); }) {}

void check_session_options(const SessionOptions& options) {
    if (options.n_ctx < 0)
        throw InvalidArgument("n_ctx must be >= 0 (0 = default), got " + std::to_string(options.n_ctx));
    if (options.n_seq < 1 || options.n_seq > SessionOptions::kMaxSequences) {
        throw InvalidArgument("n_seq must be in [1, " + std::to_string(SessionOptions::kMaxSequences) +
                              "] (the most sequences held at once), got " + std::to_string(options.n_seq));
    }
    if (options.max_draft_tokens < 0 || options.max_draft_tokens > SessionOptions::kMaxDraftTokens) {
        throw InvalidArgument("max_draft_tokens must be in [0, " +
                              std::to_string(SessionOptions::kMaxDraftTokens) +
                              "] (the most draft tokens of a speculative verify step), got " +
                              std::to_string(options.max_draft_tokens));
    }
    if (options.n_threads < 0) {
        throw InvalidArgument("threads must be >= 0 (0 = one per core), got " +
                              std::to_string(options.n_threads));
    }
}

void check_options_for_model(const SessionOptions& options, const RamBudget& ram, const Model& model) {
    if (ram.bytes > 0 && !model.hp.is_moe()) {
        throw InvalidArgument("ram_budget: " + model.file->path() +
                              " is a dense model (no routed experts to stream)");
    }
    if (options.device != "cpu" && options.device != "cuda") {
        throw InvalidArgument("device must be \"cpu\" or \"cuda\", got \"" + options.device + "\"");
    }
    if (options.vram_budget > 0 && options.device != "cuda") {
        throw InvalidArgument("vram_budget is for device=\"cuda\" (this session computes on \"" +
                              options.device + "\"; use ram_budget to stream experts into RAM)");
    }
    // With a vram_budget, whether the experts stream is the tier plan's decision (plan_placement).
    if (!options.mtp_file.empty() && !options.mtp)
        throw InvalidArgument("mtp_file: " + options.mtp_file + " is for the MTP head; set mtp as well");
    if (options.mtp && options.device != "cpu")
        throw UnsupportedError(
            "mtp: the multi-token-prediction head is not on the device path yet (device=\"" + options.device +
            "\")");
    if (options.predictor != "none" && options.ram_budget == 0 && options.vram_budget == 0) {
        throw InvalidArgument("predictor '" + options.predictor +
                              "' needs a RAM budget (ram_budget / --ram-budget): with every expert resident "
                              "there is nothing to prefetch");
    }
    if (!options.cache_policy.empty()) check_replacement_policy_name(options.cache_policy);
    parse_prefetch_sizing(options.prefetch_sizing);  // a bad name fails here, predictor or not
    if (options.predictor == "custom") check_lookahead(options.lookahead);  // installed later by the host
}

RamBudget resolve_ram_budget(const SessionOptions& options, const MachineProbe& probe) {
    RamBudget r;
    if (options.ram_budget == SessionOptions::kRamBudgetAuto) {
        r.auto_choice = probe.ram_auto();
        r.bytes = r.auto_choice->budget;
    } else {
        r.bytes = options.ram_budget;
    }
    return r;
}

void check_context_size(int64_t n_ctx, int64_t n_ctx_train, bool allow_long_context,
                        const std::string& path) {
    if (n_ctx > n_ctx_train && !allow_long_context) {
        throw InvalidArgument("n_ctx " + std::to_string(n_ctx) + " is beyond the " +
                              std::to_string(n_ctx_train) + " tokens " + path +
                              " was trained on (<arch>.context_length); positions past it are "
                              "untrained and usually give garbage. Allow it with allow_long_context "
                              "(--allow-long-context) or use a smaller n_ctx");
    }
}

Placement plan_placement(const SessionOptions& options, const RamBudget& ram, const Model& model,
                         int64_t max_batch, const MachineProbe& probe) {
    const HParams& h = model.hp;
    const std::string& path = model.file->path();
    Placement p;
    p.exact = exact_mode(options);
    p.n_ctx = options.n_ctx > 0 ? options.n_ctx : std::min<int64_t>(h.n_ctx_train, 4096);
    check_context_size(p.n_ctx, h.n_ctx_train, options.allow_long_context, path);
    // deepseek4's cache row holds compressor state that must stay f32 (model/kv_cache.h): f32 by
    // default in both modes; another requested type is refused by kv_layout.
    const bool f32_state = !h.compress_ratios.empty();
    p.type_k = kv_type_for(options.cache_type_k, p.exact || f32_state);
    p.type_v = kv_type_for(options.cache_type_v, p.exact || f32_state);
    // CPU compute of VRAM misses: the mode is checked here, before any device is touched.
    p.misses.mode = parse_miss_mode(cpu_moe_forced() ? "cpu" : options.miss_route);
    p.misses.copy_bytes_per_s = options.miss_copy_bytes_per_s;
    p.misses.copy_latency_s = options.miss_copy_latency_s;
    p.misses.cpu_bytes_per_s = options.miss_cpu_bytes_per_s;
    if (p.misses.mode != MissMode::copy && !cpu_moe_forced() && options.device != "cuda") {
        throw InvalidArgument("miss_route \"" + options.miss_route +
                              "\" is for device=\"cuda\" with a vram_budget (experts missing from VRAM)");
    }
    if (options.device == "cuda") {
        // The device is the CUDA backend's decision (backend/cuda_interface.h): it checks the device,
        // the model and the VRAM before it allocates. Its KV cache is f32 in both modes (a type named
        // by the user is checked by the device plan).
        check_device_options(options, path);
        p.on_device = true;
        p.device_type_k = options.cache_type_k.empty() ? GgmlType::F32 : p.type_k;
        p.device_type_v = options.cache_type_v.empty() ? GgmlType::F32 : p.type_v;
        if (options.vram_budget > 0) plan_vram_tier(options, model, max_batch, probe, p);
        if (options.vram_budget > 0 && !p.vram_streams && options.predictor != "none") {
            throw InvalidArgument("predictor '" + options.predictor +
                                  "': every expert fits the vram_budget (" +
                                  std::to_string(options.vram_budget) +
                                  " B), so nothing streams and there is nothing to prefetch");
        }
        if (!p.vram_streams && p.misses.mode != MissMode::copy && !cpu_moe_forced()) {
            throw InvalidArgument(
                "miss_route \"" + options.miss_route +
                "\" serves experts missing from VRAM: it needs a vram_budget under which the "
                "experts stream (every expert is resident here)");
        }
    }
    // Planned (and a too-small budget refused) before the KV cache or any slot is allocated.
    if (ram.bytes > 0) plan_ram_tier(options, ram.bytes, model, max_batch, p);
    return p;
}

}  // namespace sharpi
