// Options for a Session and for sampling. Defaults are what `sharpi run` uses.
#pragma once

#include <cstdint>
#include <string>

namespace sharpi {

struct SessionOptions {
    int n_threads = 0;  // 0: one per online core
    int n_ctx = 0;      // 0: min(n_ctx_train, 4096)
    // The most sequences the session holds at once (continuous batching: Session::add_sequence,
    // decode_batch), each with its own KV cache of n_ctx positions; the RAM budget charges all n_seq.
    // 1..kMaxSequences.
    int n_seq = 1;
    static constexpr int kMaxSequences = 256;
    // Speculative decoding: the most draft tokens one verify step holds after the next token
    // (SequenceTokens::rewindable). A model with recurrent state (qwen3next, qwen35moe) keeps that
    // many extra copies of its DeltaNet state per sequence to cut a rejected draft back, and the
    // RAM budget charges them; 0 (default): no rewindable step on such a model. 0..kMaxDraftTokens.
    int max_draft_tokens = 0;
    static constexpr int kMaxDraftTokens = 64;
    // Run the file's multi-token-prediction block (model/mtp.h) beside every step, so
    // Session::draft_mtp can draft from it. Its weights stay resident and, per sequence, its KV
    // cache and the trunk's normed hidden state of every position (n_ctx x n_embd f32); the RAM
    // budget charges them. InvalidArgument for a file without the block.
    bool mtp = false;
    // With mtp: the file holding the block, when not the model's own (llama.cpp's `--mtp` export,
    // "mtp-<name>.gguf", or a trained head for a model that has none). Empty: the model file.
    std::string mtp_file;
    // Exact mode (docs/design.md §8): every matmul computes in f32 on dequantized weights (f32 activations,
    // f32 KV cache). false (default): fast mode, where activations are quantized once per matmul
    // (q8_K for K-quant weights, q8_0 / q8_1 for the 32-element types) and dotted in integers, as
    // llama.cpp does. SHARPI_EXACT=1 in the environment when the session is made also selects exact.
    bool exact = false;
    // KV cache element types, by llama.cpp's --cache-type-k / --cache-type-v names: "f32", "f16",
    // "q8_0", "q4_0" (the quantized ones need head_dim % 32 == 0). Empty: f32 in exact mode, f16
    // in fast mode. The budget charges the bytes the chosen types take.
    std::string cache_type_k;
    std::string cache_type_v;
    // n_ctx beyond the model's trained context (GGUF <arch>.context_length) is refused unless set.
    bool allow_long_context = false;
    // Record every named intermediate activation of the next decode() (see Session::dump()).
    bool dump_activations = false;
    // "cpu" or "cuda" (the CUDA backend: needs a CUDA build and a device; a typed error otherwise).
    std::string device = "cpu";
    // device="cuda": the VRAM this session may hold, through the tier planner (tier_plan.h). 0: every
    // weight resident (part 1; the whole model must fit the free VRAM). Otherwise dense weights, KV
    // cache and buffers are charged first; every expert stays resident when the rest holds them all,
    // else the routed experts stream into VRAM expert slots from the host's pinned mapping (same
    // logits, bit for bit). kVramBudgetAuto: free VRAM minus a margin. Below the minimum (dense + KV +
    // buffers + top-k slots, + staging with a predictor) is an InvalidArgument naming it.
    uint64_t vram_budget = 0;
    static constexpr uint64_t kBudgetAuto = ~uint64_t{0};
    static constexpr uint64_t kVramBudgetAuto = kBudgetAuto;
    // Experts streamed through VRAM: how a decode step serves a selected expert that is not in VRAM
    // (moe/cpu_miss.h). "copy" (default): copied, then computed by the device kernels (logits equal the
    // resident ones bit for bit). "cpu": computed on the CPU from the mapping, one activation row down
    // and one output row up (SHARPI_CPU_MOE=1 in the environment selects it). "auto": per expert, the
    // cheaper of the two by the miss cost model. cpu and auto hold the logits to the GPU-vs-CPU budget.
    std::string miss_route = "copy";
    // The cost model's inputs for "auto"; 0 (latency < 0): measured when the session opens.
    double miss_copy_bytes_per_s = 0.0;
    double miss_copy_latency_s = -1.0;
    double miss_cpu_bytes_per_s = 0.0;

    // Expert streaming (docs/design.md §2-§5). 0: every expert resident (the file is memory-mapped).
    // Otherwise the bytes this session may hold: dense weights, KV cache and buffers are charged
    // first and the rest becomes expert slots read from the file on demand. Too small a budget
    // (fewer slots than experts one token uses in a layer) is an InvalidArgument naming the minimum.
    // kRamBudgetAuto: what the process may still take (MemAvailable and its memory cgroups' limits)
    // minus a margin, measured when the session opens (AutoRamBudget, Session::auto_ram_budget).
    uint64_t ram_budget = 0;
    static constexpr uint64_t kRamBudgetAuto = kBudgetAuto;
    double slru_probation = 0.25;  // share of the cache slots in the SLRU probation segment
    // Expert-cache replacement policy (docs/cache_policies.md): "lru", "slru", "lfu", "arc", "s3fifo",
    // "prior" (reads cache_policy_file, fitted by `sharpi cache-prior`), "predictive" (keeps what the
    // predictor's hints name). Empty: the default, the policy closest to Belady on real routing.
    std::string cache_policy;
    std::string cache_policy_file;
    std::string reader = "auto";  // "auto" (io_uring when available), "uring", "pread"
    // Predictive prefetch while streaming (docs/predictors.md): "none" (reactive: a layer's misses
    // are read when its gate fires), "prev_token", "echo", "next_gate", "pregate", "cooc", "depthtime",
    // "learned", "trajectory" (these read `predictor_file`), or "custom" (the host installs one with
    // Session::set_predictor). Predicted experts are read into lookahead * top_k staging slots that
    // never evict. Needs ram_budget, or a vram_budget under which the experts stream.
    std::string predictor = "none";
    std::string predictor_file;
    int lookahead = 1;  // predict layers L+1 .. L+lookahead (1..3)
    // Do not issue a prediction whose read could only start after its layer's gate (measured
    // bandwidth and queue); false issues every prediction a staging slot can take.
    bool skip_late_prefetch = true;
    // How many predicted experts per layer are read (docs/predictors.md): "topk" (the best top_k
    // hints) or "bytes" (those whose probability x read time saved beats a wasted read's cost,
    // best expected saving first, within the staging slots).
    std::string prefetch_sizing = "topk";

    // Record compute / stall / expert-read spans for a Perfetto timeline (Session::timeline_events()).
    bool timeline = false;
};

// The options as the engine takes them, with the shorthands a host may write resolved (Session's
// constructor calls it, before any file is opened): predictor "NAME:FILE" is predictor NAME with
// predictor_file FILE; cache_policy "NAME:FILE" is cache_policy NAME with cache_policy_file FILE.
// Throws InvalidArgument when a shorthand's FILE and the *_file field both name a file and differ.
// The other options (sizes, names, budgets, types) are checked when the session opens the model.
SessionOptions resolve_session_options(const SessionOptions& options);

// How ram_budget "auto" was resolved when the session opened: budget = available - margin, measured
// before the model was loaded (Session::auto_ram_budget).
struct AutoRamBudget {
    uint64_t budget = 0;  // bytes
    uint64_t available = 0;
    uint64_t margin = 0;
    std::string source;  // what bounded `available`: "MemAvailable", or "cgroup v1 /a: limit .. - usage .."
    // "--ram-budget auto: B MiB = A MiB available (source) - margin M MiB"
    std::string describe() const;
};

// A budget option as a host writes it (ram_budget, vram_budget): "auto" in any case and with spaces
// around it is SessionOptions::kBudgetAuto, anything else a byte size (parse_byte_size's errors).
uint64_t parse_budget(const std::string& text);

// Parses a byte size with an optional unit: "6GiB", "512MiB", "1.5GB", "4096", "2G" (K/M/G/T are
// binary, KB/MB/GB/TB decimal, KiB/MiB/GiB/TiB binary). Throws InvalidArgument.
uint64_t parse_byte_size(const std::string& text);

struct SamplingParams {
    float temperature = 0.8f;     // 0: greedy
    int32_t top_k = 40;           // <= 0: disabled
    float top_p = 0.95f;          // 1: disabled
    float min_p = 0.05f;          // 0: disabled
    float repeat_penalty = 1.0f;  // 1: disabled
    int32_t repeat_last_n = 64;   // window the penalty looks back over
    uint64_t seed = 0xC0FFEE;
};

}  // namespace sharpi
