// Plain value types shared by the public API.
#pragma once

#include <cstdint>
#include <string>

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
    int64_t n_ff = 0;         // dense FFN width (0 when every layer is MoE)
    int64_t n_ff_exp = 0;     // routed expert FFN width
    int64_t n_ff_shexp = 0;   // shared expert FFN width (0 = none)
    int64_t n_expert = 0;     // 0 for dense models
    int64_t n_expert_used = 0;
    int64_t n_ctx_train = 0;
    int64_t n_ctx = 0;        // the session's context size
    uint64_t bytes_dense = 0;    // tensor bytes outside the routed experts
    uint64_t bytes_experts = 0;  // tensor bytes of ffn_{gate,up,down}_exps
};

}  // namespace sharpi
