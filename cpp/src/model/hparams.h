// Hyper-parameters of a model, read from GGUF metadata only (no per-model constants in code).
// Keys that real files omit are derived from tensor shapes, as llama.cpp does: qwen2moe files carry
// no rope.dimension_count or attention.key_length, Mixtral files no expert_feed_forward_length.
#pragma once

#include <cstdint>
#include <string>

#include "cpu/ops/rope.h"

namespace sharpi {

class GgufFile;
struct ArchSpec;

struct HParams {
    std::string arch;
    int64_t n_vocab = 0;
    int64_t n_embd = 0;
    int64_t n_layer = 0;
    int64_t n_head = 0;
    int64_t n_head_kv = 0;
    int64_t head_dim = 0;  // per-head width of q and k (attention.key_length, else n_embd / n_head)
    int64_t n_ff = 0;      // dense FFN width (feed_forward_length), 0 if the model has none
    int64_t n_ff_exp = 0;
    int64_t n_ff_shexp = 0;
    int64_t n_expert = 0;
    int64_t n_expert_used = 0;
    int64_t n_ctx_train = 0;
    float rms_eps = 1e-6f;
    bool expert_weights_norm = false;  // renormalise the top-k router weights to sum 1
    cpu::RopeParams rope;

    int64_t n_embd_q() const { return n_head * head_dim; }
    int64_t n_embd_kv() const { return n_head_kv * head_dim; }
    bool is_moe() const { return n_expert > 0; }
};

// Reads and validates the hyper-parameters of `spec`'s architecture. Throws MissingTensorError for a
// required key that cannot be derived, FormatError for inconsistent values, UnsupportedError for
// an unsupported rope scaling type.
HParams read_hparams(const GgufFile& file, const ArchSpec& spec);

}  // namespace sharpi
