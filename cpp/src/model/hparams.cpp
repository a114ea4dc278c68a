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
    // MLA (deepseek2): written as MQA over the latent, so key_length = kv_lora_rank + n_rot and
    // value_length = kv_lora_rank; the real per-head widths are the *_mla keys.
    hp.n_lora_kv = static_cast<int64_t>(f.get_uint_or(a + "attention.kv_lora_rank", 0));
    if (hp.n_lora_kv > 0) {
        hp.n_lora_q = static_cast<int64_t>(f.get_uint_or(a + "attention.q_lora_rank", 0));
        hp.n_embd_head_k_mla = static_cast<int64_t>(f.get_uint(a + "attention.key_length_mla"));
        hp.n_embd_head_v_mla = static_cast<int64_t>(f.get_uint(a + "attention.value_length_mla"));
        if (hp.n_head_kv != 1 || value_length != hp.n_lora_kv || hp.head_dim <= hp.n_lora_kv ||
            hp.n_embd_head_k_mla <= hp.head_dim - hp.n_lora_kv || hp.n_embd_head_v_mla <= 0) {
            throw fail("inconsistent MLA hyper-parameters: head_count_kv " + std::to_string(hp.n_head_kv) +
                       ", key_length " + std::to_string(hp.head_dim) + ", value_length " +
                       std::to_string(value_length) + ", kv_lora_rank " + std::to_string(hp.n_lora_kv) +
                       ", key_length_mla " + std::to_string(hp.n_embd_head_k_mla) + ", value_length_mla " +
                       std::to_string(hp.n_embd_head_v_mla));
        }
    } else if (value_length != hp.head_dim) {
        throw UnsupportedError("[model] " + f.path() + ": value_length != key_length");
    }
    hp.n_layer_dense_lead = static_cast<int64_t>(f.get_uint_or(a + "leading_dense_block_count", 0));
    if (hp.n_layer_dense_lead < 0 || hp.n_layer_dense_lead > hp.n_layer)
        throw fail("leading_dense_block_count " + std::to_string(hp.n_layer_dense_lead) + " > block_count");

    // The vocabulary is whatever token_embd holds (some files omit vocab_size).
    hp.n_vocab = tensor_dim(f, "token_embd.weight", 1);
    if (hp.n_vocab <= 0) hp.n_vocab = static_cast<int64_t>(f.get_uint_or(a + "vocab_size", 0));

    if (hp.n_expert > 0) {
        if (hp.n_expert_used <= 0 || hp.n_expert_used > hp.n_expert) {
            throw fail("expert_used_count " + std::to_string(hp.n_expert_used) + " not in [1, expert_count " +
                       std::to_string(hp.n_expert) + "]");
        }
        // The first MoE layer's tensors (deepseek2's leading layers are dense).
        const std::string moe_blk = "blk." + std::to_string(hp.n_layer_dense_lead) + ".";
        hp.n_ff_exp = static_cast<int64_t>(f.get_uint_or(a + "expert_feed_forward_length", 0));
        if (hp.n_ff_exp == 0) hp.n_ff_exp = tensor_dim(f, moe_blk + "ffn_gate_exps.weight", 1);
        if (hp.n_ff_exp == 0) hp.n_ff_exp = hp.n_ff;  // Mixtral: feed_forward_length is the expert width
        hp.n_ff_shexp = static_cast<int64_t>(f.get_uint_or(a + "expert_shared_feed_forward_length", 0));
        if (hp.n_ff_shexp == 0) hp.n_ff_shexp = tensor_dim(f, moe_blk + "ffn_gate_shexp.weight", 1);
    }
    hp.expert_weights_norm = f.get_bool_or(a + "expert_weights_norm", spec.expert_weights_norm);
    cpu::RouterParams& r = hp.router;
    r.normalize_topk = hp.expert_weights_norm;
    r.weights_scale = static_cast<float>(f.get_float_or(a + "expert_weights_scale", 1.0));
    // llama.cpp's enum: 1 softmax, 2 sigmoid; absent means softmax (DeepSeek-V2 files carry none).
    const uint64_t gating = f.get_uint_or(a + "expert_gating_func", 1);
    if (gating != 1 && gating != 2) {
        throw UnsupportedError("[model] " + f.path() + ": expert_gating_func " + std::to_string(gating) +
                               " is not supported (1 softmax, 2 sigmoid)");
    }
    r.gating = gating == 2 ? cpu::Gating::sigmoid : cpu::Gating::softmax;
    r.n_group = static_cast<int64_t>(f.get_uint_or(a + "expert_group_count", 1));
    r.n_group_used =
        static_cast<int64_t>(f.get_uint_or(a + "expert_group_used_count", static_cast<uint64_t>(r.n_group)));
    if (hp.n_expert > 0 &&
        (r.n_group <= 0 || hp.n_expert % r.n_group != 0 || r.n_group_used <= 0 ||
         r.n_group_used > r.n_group || r.n_group_used * (hp.n_expert / r.n_group) < hp.n_expert_used)) {
        throw fail("expert groups: " + std::to_string(r.n_group) + " groups, " +
                   std::to_string(r.n_group_used) + " used, do not fit expert_count " +
                   std::to_string(hp.n_expert) + " and expert_used_count " +
                   std::to_string(hp.n_expert_used));
    }

    hp.rope.type = spec.rope_type;
    hp.rope.n_rot =
        static_cast<int64_t>(f.get_uint_or(a + "rope.dimension_count", static_cast<uint64_t>(hp.head_dim)));
    if (hp.rope.n_rot <= 0 || hp.rope.n_rot > hp.head_dim || hp.rope.n_rot % 2 != 0 ||
        (hp.is_mla() && hp.rope.n_rot != hp.head_dim - hp.n_lora_kv)) {
        throw fail("rope.dimension_count " + std::to_string(hp.rope.n_rot) +
                   " must be even and <= head_dim " + std::to_string(hp.head_dim));
    }
    hp.rope.freq_base = static_cast<float>(f.get_float_or(a + "rope.freq_base", 10000.0));
    const std::string scaling = f.get_string_or(a + "rope.scaling.type", "none");
    const double factor = f.get_float_or(a + "rope.scaling.factor", 0.0);
    // The softmax scale of attention; MLA scales by its per-head q/k width (key_length is the
    // latent's there), times YaRN's mscale^2 below.
    hp.attn_scale = 1.0f / std::sqrt(static_cast<float>(hp.is_mla() ? hp.n_embd_head_k_mla : hp.head_dim));
    if (scaling == "linear" && factor > 0.0) {
        hp.rope.freq_scale = static_cast<float>(1.0 / factor);
    } else if (scaling == "yarn" && factor > 1.0 && hp.is_mla()) {
        // YaRN as llama.cpp runs deepseek2: the RoPE angles interpolate outside the correction
        // range; cos/sin keep magnitude attn_factor (1 unless the file says otherwise), and the
        // softmax scale grows by mscale^2, mscale = attn_factor * (1 + 0.1 * mscale_all_dim *
        // ln(factor)). The converter writes yarn_log_multiplier = 0.1 * mscale_all_dim.
        const double attn_factor = f.get_float_or(a + "rope.scaling.attn_factor", 1.0);
        const double log_mul = f.get_float_or(a + "rope.scaling.yarn_log_multiplier", 0.0);
        const int64_t n_ctx_orig = static_cast<int64_t>(
            f.get_uint_or(a + "rope.scaling.original_context_length", static_cast<uint64_t>(hp.n_ctx_train)));
        hp.rope.freq_scale = static_cast<float>(1.0 / factor);
        hp.rope.ext_factor = static_cast<float>(f.get_float_or(a + "rope.scaling.yarn_ext_factor", 1.0));
        hp.rope.mscale = static_cast<float>(attn_factor);
        cpu::rope_yarn_corr_dims(hp.rope.n_rot, n_ctx_orig, hp.rope.freq_base,
                                 static_cast<float>(f.get_float_or(a + "rope.scaling.yarn_beta_fast", 32.0)),
                                 static_cast<float>(f.get_float_or(a + "rope.scaling.yarn_beta_slow", 1.0)),
                                 &hp.rope.corr_low, &hp.rope.corr_high);
        const double mscale = attn_factor * (1.0 + log_mul * std::log(factor));
        hp.attn_scale =
            static_cast<float>(mscale * mscale / std::sqrt(static_cast<double>(hp.n_embd_head_k_mla)));
    } else if (scaling != "none" && !(scaling == "linear" && factor == 0.0)) {
        throw UnsupportedError("[model] " + f.path() + ": rope scaling type '" + scaling +
                               "' is not supported (supported: none, linear; yarn for deepseek2)");
    }
    return hp;
}

}  // namespace sharpi
