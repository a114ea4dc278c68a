// Plain value types shared by the public API.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace sharpi {

using token_t = int32_t;

// What a loaded model is, read from GGUF metadata (see Session::info()).
struct ModelInfo {
    std::string path;
    std::string arch;  // general.architecture: "llama", "qwen2moe", "qwen3moe", "olmoe", ...
    std::string name;  // general.name, may be empty
    int64_t n_vocab = 0;
    int64_t n_embd = 0;
    int64_t n_layer = 0;
    int64_t n_head = 0;
    int64_t n_head_kv = 0;
    int64_t head_dim = 0;
    int64_t n_ff = 0;        // dense FFN width (0 when every layer is MoE)
    int64_t n_ff_exp = 0;    // routed expert FFN width
    int64_t n_ff_shexp = 0;  // shared expert FFN width (0 = none)
    int64_t n_expert = 0;    // 0 for dense models
    int64_t n_expert_used = 0;
    int64_t n_layer_dense_lead = 0;  // leading layers with a dense FFN instead of experts (deepseek2)
    int64_t n_ctx_train = 0;
    int64_t n_ctx = 0;             // the session's context size (of each sequence)
    int64_t n_seq = 1;             // the most sequences it holds at once (SessionOptions::n_seq)
    int64_t max_step_tokens = 0;   // the most tokens one decode_batch step takes: max(n_ctx, 256)
    int64_t max_draft_tokens = 0;  // SessionOptions::max_draft_tokens
    bool recurrent = false;        // the model keeps recurrent (DeltaNet) state (qwen3next, qwen35moe)
    int64_t n_layer_nextn = 0;     // the file's multi-token-prediction blocks (nextn_predict_layers)
    bool mtp = false;              // SessionOptions::mtp: the first of them runs (Session::draft_mtp)
    uint64_t bytes_dense = 0;      // tensor bytes outside the routed experts
    uint64_t bytes_experts = 0;    // tensor bytes of ffn_{gate,up,down}_exps
    std::string cache_type_k;      // the KV cache's stored types ("f32", "f16", "q8_0", "q4_0")
    std::string cache_type_v;
    uint64_t bytes_kv = 0;  // the KV caches' allocation at n_ctx, all n_seq sequences
};

// One sequence's part of a batched decode step (Session::decode_batch): its new tokens, and whether
// the logits of every one of them are wanted (else of the last one only).
struct SequenceTokens {
    int32_t seq = 0;
    std::vector<token_t> tokens;
    bool all_logits = false;
    // The sequence may afterwards be truncated back to any position inside these tokens (a
    // speculative verify step dropping a rejected draft). Attention-only models can always; a model
    // with recurrent state keeps its DeltaNet state after each token, at most
    // SessionOptions::max_draft_tokens + 1 tokens (InvalidArgument otherwise).
    bool rewindable = false;
};

// What a decode step would read from the model file (Session::predict_step_reads): bytes[j] for
// a step of the first j + 1 tokens, the expert bytes its echo-guessed experts (the experts those
// tokens chose at their latest earlier occurrences in the sequence) not held by the cache would
// read; a token with no earlier occurrence counts top_k experts per MoE layer, each missing as
// often as the layer's experts are absent now. All 0 with every expert resident.
struct StepReadEstimate {
    std::vector<double> bytes;
    double bytes_per_ms = 0.0;  // the reader's measured bandwidth (0: not measured yet, or resident)
};

// One named activation captured during decode() when SessionOptions::dump_activations is set.
// Name follows llama.cpp's convention with the layer appended: "ffn_moe_out-3", "result_norm".
struct Activation {
    std::vector<int64_t> shape;  // [n_tokens, width]
    std::vector<float> data;
};

// Named activations of the last decode ("<name>-<layer>"), Session::dump().
using ActivationDump = std::map<std::string, Activation>;

// One span of the timeline (Session::timeline_events()): track "compute", "stall" or "reader".
struct TimelineEvent {
    std::string track;
    std::string name;
    double start_us = 0.0;
    double dur_us = 0.0;
};

// Expert-cache counters of one MoE layer (docs/design.md §7 names). A demand acquisition is a hit when
// the expert was ready or already loading, a miss when it needed a new read.
struct LayerExpertStats {
    uint64_t accesses = 0;
    uint64_t hits = 0;
    uint64_t misses = 0;
    uint64_t evictions = 0;              // experts of this layer evicted from the cache
    uint64_t bytes_read = 0;             // requested bytes (the aligned superset actually read can be larger)
    double stall_ms = 0.0;               // time the decode thread waited on this layer's expert reads
    uint64_t prefetch_issued = 0;        // expert reads started by the prefetcher
    uint64_t prefetch_used = 0;          // prefetched experts the gate then selected
    uint64_t prefetch_timely = 0;        // ... of which were ready when the gate fired
    uint64_t prefetch_late = 0;          // ... of which were still loading
    uint64_t prefetch_wasted_bytes = 0;  // bytes of prefetched experts nobody selected
    uint64_t prefetch_skipped = 0;       // hints for this layer not issued: no staging slot, or too late
    // Prediction quality for this layer (docs/predictors.md). Each prediction set made for it (one per
    // lookahead distance and token) counts once: recall_at_k = predicted_correct / (predictions * k),
    // precision = predicted_correct / predicted_experts.
    uint64_t predictions = 0;
    uint64_t predicted_correct = 0;  // sum of |prediction set ∩ selected|
    uint64_t predicted_experts = 0;  // sum of |prediction set|
    uint64_t hints_dropped = 0;  // hints this layer's predictor call returned out of range (or a failed call)
};

// Counters since the session was created (or reset_stats()). Empty `layers` when every expert is
// resident (no cache).
struct ExpertCacheStats {
    std::string tier = "ram";  // the cache's tier (moe/expert_tier.h): "ram", "vram", or "copy" in host tests
    std::string reader;        // "io_uring" or "pread" (ram); the tier's filler otherwise
    std::string reader_detail;  // the reader's describe(): its setup, and why "auto" fell back to pread
    std::string reader_note;    // readers "auto" passed over before these, and why (cuFile's probe)
    uint64_t n_slots = 0;       // cache slots (under the replacement policy)
    uint64_t n_staging = 0;     // prefetch staging slots
    uint64_t slot_bytes = 0;
    uint64_t budget_bytes = 0;
    uint64_t fixed_bytes = 0;  // dense weights + KV cache + buffers charged before slots
    std::vector<LayerExpertStats> layers;
    // [n_layer * n_expert], index il * n_expert + e
    std::vector<uint64_t> expert_accesses;
    std::vector<uint64_t> expert_misses;
    double io_busy_ms = 0.0;  // time at least one expert read was outstanding (seen at poll points)
    double decode_ms = 0.0;   // wall time inside decode()
    double predict_ms = 0.0;  // time in the predictor and the prefetcher (part of decode_ms)
    uint64_t predictor_calls = 0;
    uint64_t predictor_failures = 0;  // calls that threw (their hints dropped)
    // VRAM tier with CPU compute of misses (SessionOptions::miss_route): selected experts the CPU
    // computed instead of copying them, and the cost model's inputs ("copy" mode: all zero).
    uint64_t cpu_experts = 0;
    double miss_copy_bytes_per_s = 0.0, miss_copy_latency_s = 0.0, miss_cpu_bytes_per_s = 0.0;
};

}  // namespace sharpi
