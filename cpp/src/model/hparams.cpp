#include "model/hparams.h"

#include <cmath>

#include "gguf/gguf_file.h"
#include "model/arch.h"
#include "sharpi/errors.h"

namespace sharpi {

namespace {

int64_t tensor_dim(const GgufFile& f, const std::string& name, size_t dim) {
    const GgufTensor* t = f.find_tensor(name);
    return (t && t->ne.size() > dim) ? t->ne[dim] : 0;
}

// The Gated DeltaNet keys of a hybrid file (present iff {arch}.ssm.conv_kernel is).
void read_ssm_hparams(const GgufFile& f, const std::string& a, HParams& hp) {
    if (!f.has(a + "ssm.conv_kernel")) return;
    auto fail = [&](const std::string& what) { return FormatError("[model] " + f.path() + ": " + what); };
    hp.ssm_d_conv = static_cast<int64_t>(f.get_uint(a + "ssm.conv_kernel"));
    hp.ssm_d_state = static_cast<int64_t>(f.get_uint(a + "ssm.state_size"));
    hp.ssm_n_group = static_cast<int64_t>(f.get_uint(a + "ssm.group_count"));
    hp.ssm_dt_rank = static_cast<int64_t>(f.get_uint(a + "ssm.time_step_rank"));
    hp.ssm_d_inner = static_cast<int64_t>(f.get_uint(a + "ssm.inner_size"));
    if (hp.ssm_d_conv < 1 || hp.ssm_d_state <= 0 || hp.ssm_n_group <= 0 || hp.ssm_dt_rank <= 0 ||
        hp.ssm_dt_rank % hp.ssm_n_group != 0 || hp.ssm_d_inner % hp.ssm_dt_rank != 0) {
        throw fail("inconsistent ssm hyper-parameters: conv_kernel " + std::to_string(hp.ssm_d_conv) +
                   ", state_size " + std::to_string(hp.ssm_d_state) + ", group_count " +
                   std::to_string(hp.ssm_n_group) + ", time_step_rank " + std::to_string(hp.ssm_dt_rank) +
                   ", inner_size " + std::to_string(hp.ssm_d_inner));
    }
    // The layer pattern: an explicit per-layer array (trunk and nextn blocks), else every
    // full_attention_interval-th layer is attention (llama.cpp's rule, default interval 4).
    const size_t n_all = static_cast<size_t>(hp.n_layer + hp.n_layer_nextn);
    hp.recurrent_layers.assign(static_cast<size_t>(hp.n_layer), false);
    if (const GgufValue* v = f.find(a + "attention.recurrent_layers")) {
        if (v->type != GgufValueType::ARRAY || v->arr_int.size() != n_all) {
            throw fail("attention.recurrent_layers must hold one flag per block (" + std::to_string(n_all) +
                       ")");
        }
        for (int64_t il = 0; il < hp.n_layer; ++il) {
            hp.recurrent_layers[static_cast<size_t>(il)] = v->arr_int[static_cast<size_t>(il)] != 0;
        }
    } else {
        const int64_t interval = static_cast<int64_t>(f.get_uint_or(a + "full_attention_interval", 4));
        if (interval < 1) throw fail("full_attention_interval must be >= 1");
        for (int64_t il = 0; il < hp.n_layer; ++il) {
            hp.recurrent_layers[static_cast<size_t>(il)] = (il + 1) % interval != 0;
        }
    }
}

}  // namespace

HParams read_hparams(const GgufFile& f, const ArchSpec& spec) {
    HParams hp;
    hp.arch = spec.name;
    const std::string a = hp.arch + ".";
    auto fail = [&](const std::string& what) { return FormatError("[model] " + f.path() + ": " + what); };

    hp.n_embd = static_cast<int64_t>(f.get_uint(a + "embedding_length"));
    hp.n_layer = static_cast<int64_t>(f.get_uint(a + "block_count"));
    hp.n_head = static_cast<int64_t>(f.get_uint(a + "attention.head_count"));
    hp.n_head_kv =
        static_cast<int64_t>(f.get_uint_or(a + "attention.head_count_kv", static_cast<uint64_t>(hp.n_head)));
    hp.n_ctx_train = static_cast<int64_t>(f.get_uint_or(a + "context_length", 2048));
    hp.n_ff = static_cast<int64_t>(f.get_uint_or(a + "feed_forward_length", 0));
    hp.rms_eps = static_cast<float>(f.get_float_or(a + "attention.layer_norm_rms_epsilon", 1e-6));
    hp.n_expert = static_cast<int64_t>(f.get_uint_or(a + "expert_count", 0));
    hp.n_expert_used = static_cast<int64_t>(f.get_uint_or(a + "expert_used_count", 0));

    // block_count includes the nextn (MTP) blocks; the trunk is the rest.
    hp.n_layer_nextn = static_cast<int64_t>(f.get_uint_or(a + "nextn_predict_layers", 0));
    if (hp.n_layer_nextn < 0 || hp.n_layer_nextn >= hp.n_layer)
        throw fail("nextn_predict_layers " + std::to_string(hp.n_layer_nextn) + " leaves no trunk layers");
    hp.n_layer -= hp.n_layer_nextn;

    if (hp.n_embd <= 0 || hp.n_layer <= 0 || hp.n_head <= 0 || hp.n_head_kv <= 0 ||
        hp.n_head % hp.n_head_kv != 0) {
        throw fail("inconsistent attention hyper-parameters: n_embd " + std::to_string(hp.n_embd) +
                   ", n_layer " + std::to_string(hp.n_layer) + ", n_head " + std::to_string(hp.n_head) +
                   ", n_head_kv " + std::to_string(hp.n_head_kv));
    }
    // Per-head width: explicit in qwen3 files, implied by n_embd / n_head elsewhere.
    hp.head_dim = static_cast<int64_t>(f.get_uint_or(a + "attention.key_length", 0));
    if (hp.head_dim == 0) {
        if (hp.n_embd % hp.n_head != 0)
            throw fail("n_embd is not a multiple of n_head and key_length is absent");
        hp.head_dim = hp.n_embd / hp.n_head;
    }
    const int64_t value_length =
        static_cast<int64_t>(f.get_uint_or(a + "attention.value_length", hp.head_dim));
    if (value_length != hp.head_dim)
        throw UnsupportedError("[model] " + f.path() + ": value_length != key_length");

    // The vocabulary is whatever token_embd holds (some files omit vocab_size).
    hp.n_vocab = tensor_dim(f, "token_embd.weight", 1);
    if (hp.n_vocab <= 0) hp.n_vocab = static_cast<int64_t>(f.get_uint_or(a + "vocab_size", 0));

    if (hp.n_expert > 0) {
        if (hp.n_expert_used <= 0 || hp.n_expert_used > hp.n_expert) {
            throw fail("expert_used_count " + std::to_string(hp.n_expert_used) + " not in [1, expert_count " +
                       std::to_string(hp.n_expert) + "]");
        }
        hp.n_ff_exp = static_cast<int64_t>(f.get_uint_or(a + "expert_feed_forward_length", 0));
        if (hp.n_ff_exp == 0) hp.n_ff_exp = tensor_dim(f, "blk.0.ffn_gate_exps.weight", 1);
        if (hp.n_ff_exp == 0) hp.n_ff_exp = hp.n_ff;  // Mixtral: feed_forward_length is the expert width
        hp.n_ff_shexp = static_cast<int64_t>(f.get_uint_or(a + "expert_shared_feed_forward_length", 0));
        if (hp.n_ff_shexp == 0) hp.n_ff_shexp = tensor_dim(f, "blk.0.ffn_gate_shexp.weight", 1);
    }
    read_ssm_hparams(f, a, hp);
    hp.expert_weights_norm = f.get_bool_or(a + "expert_weights_norm", spec.expert_weights_norm);

    hp.rope.type = spec.rope_type;
    hp.rope.n_rot =
        static_cast<int64_t>(f.get_uint_or(a + "rope.dimension_count", static_cast<uint64_t>(hp.head_dim)));
    if (hp.rope.n_rot <= 0 || hp.rope.n_rot > hp.head_dim || hp.rope.n_rot % 2 != 0) {
        throw fail("rope.dimension_count " + std::to_string(hp.rope.n_rot) +
                   " must be even and <= head_dim " + std::to_string(hp.head_dim));
    }
    hp.rope.freq_base = static_cast<float>(f.get_float_or(a + "rope.freq_base", 10000.0));
    const std::string scaling = f.get_string_or(a + "rope.scaling.type", "none");
    const double factor = f.get_float_or(a + "rope.scaling.factor", 0.0);
    if (scaling == "linear" && factor > 0.0) {
        hp.rope.freq_scale = static_cast<float>(1.0 / factor);
    } else if (scaling != "none" && !(scaling == "linear" && factor == 0.0)) {
        throw UnsupportedError("[model] " + f.path() + ": rope scaling type '" + scaling +
                               "' is not supported (supported: none, linear)");
    }
    return hp;
}

}  // namespace sharpi
