#include "model/hparams.h"

#include <algorithm>
#include <cmath>

#include "cpu/ops/rope.h"
#include "gguf/gguf_file.h"
#include "model/arch.h"
#include "sharpi/errors.h"

namespace sharpi {

namespace {

// Caps on hyper-parameters read from a file, checked before anything is sized by them (layers,
// KV cache, expert tables). Each is far above every real model (126 layers, n_embd 16384, 128 heads,
// 512 experts, contexts of 1M tokens, head_dim 256) and keeps every product the engine forms of two
// or three of them (n_layer * n_expert, n_head * head_dim, n_ctx * n_embd_kv * n_layer) well
// inside int64, which the checked multiplies below verify anyway.
constexpr int64_t kMaxLayers = 1 << 12;
constexpr int64_t kMaxEmbd = 1 << 20;
constexpr int64_t kMaxHeads = 1 << 14;
constexpr int64_t kMaxHeadDim = 1 << 14;
constexpr int64_t kMaxExperts = 1 << 16;
constexpr int64_t kMaxFfn = 1 << 22;
constexpr int64_t kMaxCtxTrain = int64_t{1} << 26;

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

// DeepSeek-V4's keys (model/archs/deepseek4.cpp has the arithmetic they parameterise).
void read_deepseek4_hparams(const GgufFile& f, const std::string& a, HParams& hp) {
    auto fail = [&](const std::string& what) { return FormatError("[model] " + f.path() + ": " + what); };
    auto count = [&](const std::string& key, int64_t cap) {
        const uint64_t v = f.get_uint(a + key);
        if (v > static_cast<uint64_t>(cap)) throw fail(key + " = " + std::to_string(v) + " is out of range");
        return static_cast<int64_t>(v);
    };
    hp.hc_mult = count("hyper_connection.count", 64);
    hp.hc_sinkhorn_iters = count("hyper_connection.sinkhorn_iterations", 1 << 16);
    if (!f.has(a + "hyper_connection.epsilon"))
        throw fail("missing metadata key " + a + "hyper_connection.epsilon");
    hp.hc_eps = static_cast<float>(f.get_float_or(a + "hyper_connection.epsilon", 0.0));
    hp.n_lora_q = count("attention.q_lora_rank", kMaxEmbd);
    hp.o_groups = count("attention.output_group_count", kMaxHeads);
    hp.o_lora_rank = count("attention.output_lora_rank", kMaxEmbd);
    hp.n_hash_layers = static_cast<int64_t>(f.get_uint_or(a + "hash_layer_count", 0));
    hp.indexer_n_head = static_cast<int64_t>(f.get_uint_or(a + "attention.indexer.head_count", 0));
    hp.indexer_head_dim = static_cast<int64_t>(f.get_uint_or(a + "attention.indexer.key_length", 0));
    hp.indexer_top_k = static_cast<int64_t>(f.get_uint_or(a + "attention.indexer.top_k", 0));
    if (hp.hc_mult < 2 || hp.hc_sinkhorn_iters < 1 || hp.n_lora_q < 1 || hp.o_groups < 1 ||
        hp.o_lora_rank < 1 || hp.n_head % hp.o_groups != 0 || hp.n_head_kv != 1 || hp.n_swa < 1 ||
        hp.n_hash_layers < 0 || hp.n_hash_layers > hp.n_layer || hp.indexer_n_head < 0 ||
        hp.indexer_n_head > kMaxHeads || hp.indexer_head_dim < 0 || hp.indexer_head_dim > kMaxHeadDim) {
        throw fail("inconsistent deepseek4 hyper-parameters: hyper_connection.count " +
                   std::to_string(hp.hc_mult) + ", q_lora_rank " + std::to_string(hp.n_lora_q) +
                   ", output_group_count " + std::to_string(hp.o_groups) + " (must divide head_count " +
                   std::to_string(hp.n_head) + "), head_count_kv " + std::to_string(hp.n_head_kv) +
                   " (must be 1), sliding_window " + std::to_string(hp.n_swa) + ", hash_layer_count " +
                   std::to_string(hp.n_hash_layers));
    }
    // hyper_connection.count >= 2: the engine widens the residual (and runs the hc head) exactly when
    // hc_mult > 1.
    // Per-block arrays cover the nextn (MTP) blocks too (llama.cpp requires block_count entries; its
    // converter's --mtp sidecar counts the block): MtpHead takes the block's entry.
    const int64_t n_all = hp.n_layer + hp.n_layer_nextn;
    const GgufValue* ratios = f.find(a + "attention.compress_ratios");
    if (!ratios || ratios->type != GgufValueType::ARRAY ||
        ratios->arr_int.size() < static_cast<size_t>(n_all)) {
        throw fail("attention.compress_ratios must hold one ratio per block (" + std::to_string(n_all) + ")");
    }
    bool any_csa = false;
    for (int64_t il = 0; il < n_all; ++il) {
        const int64_t r = ratios->arr_int[static_cast<size_t>(il)];
        if (r != 0 && r != 4 && r != 128) {
            throw UnsupportedError("[model] " + f.path() + ": deepseek4 layer " + std::to_string(il) +
                                   " has compress ratio " + std::to_string(r) +
                                   " (supported, as in llama.cpp: 0 sliding window, 4 CSA, 128 HCA)");
        }
        any_csa = any_csa || r == 4;
        hp.compress_ratios.push_back(r);
    }
    if (any_csa && (hp.indexer_n_head < 1 || hp.indexer_head_dim < hp.rope.n_rot || hp.indexer_top_k < 1))
        throw fail("deepseek4 CSA layers need attention.indexer.head_count, key_length >= n_rot and top_k");
    if (hp.rope.freq_scale != 1.0f && hp.rope.ext_factor == 0.0f) {
        throw UnsupportedError("[model] " + f.path() +
                               ": deepseek4 with linear rope scaling is not supported (YaRN is)");
    }
    // Two RoPEs: the sliding-window-only layers rotate with rope.freq_base and no scaling; the
    // compressed layers (and their compressors and indexer) with compress_rope_freq_base and the
    // file's YaRN, whose cos/sin keep magnitude 1 (transformers forces attention_factor 1.0 there;
    // llama.cpp cancels ggml's built-in YaRN magnitude the same way).
    if (!f.has(a + "attention.compress_rope_freq_base"))
        throw fail("missing metadata key " + a + "attention.compress_rope_freq_base");
    hp.compress_rope = hp.rope;
    hp.compress_rope.freq_base =
        static_cast<float>(f.get_float_or(a + "attention.compress_rope_freq_base", 0.0));
    hp.compress_rope.mscale = 1.0f;
    if (hp.rope.ext_factor != 0.0f) {
        const int64_t n_ctx_orig = static_cast<int64_t>(
            f.get_uint_or(a + "rope.scaling.original_context_length", static_cast<uint64_t>(hp.n_ctx_train)));
        cpu::rope_yarn_corr_dims(hp.rope.n_rot, n_ctx_orig, hp.compress_rope.freq_base,
                                 static_cast<float>(f.get_float_or(a + "rope.scaling.yarn_beta_fast", 32.0)),
                                 static_cast<float>(f.get_float_or(a + "rope.scaling.yarn_beta_slow", 1.0)),
                                 &hp.compress_rope.corr_low, &hp.compress_rope.corr_high);
    }
    hp.rope.freq_scale = 1.0f;
    hp.rope.ext_factor = 0.0f;
    hp.rope.mscale = 1.0f;
    hp.rope.corr_low = hp.rope.corr_high = 0.0f;
    // Per-layer limits (an array, or one value for every layer); absent: no clamp.
    auto per_layer = [&](const std::string& key, const std::vector<float>& def) {
        const GgufValue* v = f.find(a + key);
        if (!v) return def;
        std::vector<float> out;
        if (v->type == GgufValueType::ARRAY) {
            if (v->arr_float.size() < static_cast<size_t>(n_all))
                throw fail(key + " must hold one value per block (" + std::to_string(n_all) + ")");
            for (int64_t il = 0; il < n_all; ++il)
                out.push_back(static_cast<float>(v->arr_float[static_cast<size_t>(il)]));
        } else {
            out.assign(static_cast<size_t>(n_all), static_cast<float>(f.get_float_or(a + key, 0.0)));
        }
        return out;
    };
    hp.swiglu_clamp_exp = per_layer("swiglu_clamp_exp", std::vector<float>(static_cast<size_t>(n_all), 0.0f));
    hp.swiglu_clamp_shexp = per_layer("swiglu_clamp_shexp", hp.swiglu_clamp_exp);
    hp.attn_scale = 1.0f / std::sqrt(static_cast<float>(hp.head_dim));
}

// A per-layer count that a file writes either as one number or as an array of one value per block
// (nemotron_h_moe's head_count_kv and feed_forward_length): the array, or empty for a scalar or an
// absent key. Values must be in [0, cap].
std::vector<int64_t> per_layer_counts(const GgufFile& f, const std::string& key, int64_t cap) {
    const GgufValue* v = f.find(key);
    if (!v || v->type != GgufValueType::ARRAY) return {};
    for (int64_t x : v->arr_int) {
        if (x < 0 || x > cap)
            throw FormatError("[model] " + f.path() + ": " + key + " holds " + std::to_string(x) +
                              ", outside [0, " + std::to_string(cap) + "]");
    }
    return v->arr_int;
}

// The largest value of a per-layer array, after checking that its nonzero entries agree (the
// engine sizes one KV row and one FFN width for every layer that has them).
int64_t common_nonzero(const GgufFile& f, const std::string& key, const std::vector<int64_t>& values) {
    int64_t common = 0;
    for (int64_t x : values) {
        if (x == 0) continue;
        if (common != 0 && x != common)
            throw UnsupportedError("[model] " + f.path() + ": " + key +
                                   " differs between layers; per-layer widths are not supported");
        common = x;
    }
    return common;
}

}  // namespace

HParams read_hparams(const GgufFile& f, const ArchSpec& spec) {
    HParams hp;
    hp.arch = spec.name;
    const std::string a = hp.arch + ".";
    auto fail = [&](const std::string& what) { return FormatError("[model] " + f.path() + ": " + what); };
    // A count from the file: FormatError when above `cap` (this also keeps huge u64 values, which
    // would read as negative int64, out).
    auto capped = [&](const std::string& key, uint64_t value, int64_t cap) {
        if (value > static_cast<uint64_t>(cap)) {
            throw fail("metadata key '" + key + "' = " + std::to_string(value) + " exceeds the cap of " +
                       std::to_string(cap) + " (corrupt or hostile file)");
        }
        return static_cast<int64_t>(value);
    };
    auto get = [&](const std::string& key, int64_t cap) { return capped(key, f.get_uint(a + key), cap); };
    auto get_or = [&](const std::string& key, uint64_t def, int64_t cap) {
        return capped(key, f.get_uint_or(a + key, def), cap);
    };

    hp.n_embd = get("embedding_length", kMaxEmbd);
    hp.n_layer = get("block_count", kMaxLayers);
    hp.n_head = get("attention.head_count", kMaxHeads);
    const std::vector<int64_t> kv_per_layer = per_layer_counts(f, a + "attention.head_count_kv", kMaxHeads);
    const std::vector<int64_t> ff_per_layer = per_layer_counts(f, a + "feed_forward_length", kMaxFfn);
    hp.n_head_kv = kv_per_layer.empty()
                       ? get_or("attention.head_count_kv", static_cast<uint64_t>(hp.n_head), kMaxHeads)
                       : common_nonzero(f, a + "attention.head_count_kv", kv_per_layer);
    if (hp.n_head_kv == 0 && !kv_per_layer.empty()) hp.n_head_kv = hp.n_head;  // no attention block at all
    hp.n_ctx_train = get_or("context_length", 2048, kMaxCtxTrain);
    // A per-layer feed_forward_length (nemotron_h_moe) gives the MoE blocks' expert width; those
    // archs have no dense FFN.
    hp.n_ff = ff_per_layer.empty() ? get_or("feed_forward_length", 0, kMaxFfn) : 0;
    // RMSNorm epsilon; nemotron_h_moe files carry it only as attention.layer_norm_epsilon.
    hp.rms_eps = static_cast<float>(f.get_float_or(a + "attention.layer_norm_rms_epsilon",
                                                   f.get_float_or(a + "attention.layer_norm_epsilon", 1e-6)));
    hp.n_expert = get_or("expert_count", 0, kMaxExperts);
    hp.n_expert_used = get_or("expert_used_count", 0, kMaxExperts);

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
    hp.head_dim = get_or("attention.key_length", 0, kMaxHeadDim);
    if (hp.head_dim == 0) {
        if (hp.n_embd % hp.n_head != 0)
            throw fail("n_embd is not a multiple of n_head and key_length is absent");
        hp.head_dim = hp.n_embd / hp.n_head;
    }
    const int64_t value_length =
        get_or("attention.value_length", static_cast<uint64_t>(hp.head_dim), kMaxHeadDim);
    // MLA (deepseek2): written as MQA over the latent, so key_length = kv_lora_rank + n_rot and
    // value_length = kv_lora_rank; the real per-head widths are the *_mla keys.
    hp.n_lora_kv = get_or("attention.kv_lora_rank", 0, kMaxHeadDim);
    if (hp.n_lora_kv > 0) {
        hp.n_lora_q = get_or("attention.q_lora_rank", 0, kMaxEmbd);
        hp.n_embd_head_k_mla = get("attention.key_length_mla", kMaxHeadDim);
        hp.n_embd_head_v_mla = get("attention.value_length_mla", kMaxHeadDim);
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
    // The DSA lightning indexer (deepseek32): llama.cpp requires all three keys for the arch.
    if (hp.arch == "deepseek32") {
        hp.indexer_n_head = get("attention.indexer.head_count", kMaxHeadDim);
        hp.indexer_head_dim = get("attention.indexer.key_length", kMaxHeadDim);
        hp.indexer_top_k = get("attention.indexer.top_k", kMaxCtxTrain);
        if (!hp.is_mla() || hp.n_lora_q <= 0 || hp.indexer_n_head <= 0 || hp.indexer_head_dim <= 0 ||
            hp.indexer_top_k <= 0) {
            throw fail("inconsistent DSA hyper-parameters: kv_lora_rank " + std::to_string(hp.n_lora_kv) +
                       ", q_lora_rank " + std::to_string(hp.n_lora_q) + ", indexer.head_count " +
                       std::to_string(hp.indexer_n_head) + ", indexer.key_length " +
                       std::to_string(hp.indexer_head_dim) + ", indexer.top_k " +
                       std::to_string(hp.indexer_top_k) +
                       " (the indexer reads the q LoRA and scores at least one position)");
        }
    }
    hp.n_layer_dense_lead = get_or("leading_dense_block_count", 0, kMaxLayers);
    hp.n_swa = get_or("attention.sliding_window", 0, kMaxCtxTrain);
    if (hp.n_layer_dense_lead > hp.n_layer)
        throw fail("leading_dense_block_count " + std::to_string(hp.n_layer_dense_lead) + " > block_count");
    // The widths the engine sizes buffers with; the caps make overflow impossible, this proves it.
    int64_t product = 0;
    if (__builtin_mul_overflow(hp.n_head, hp.head_dim, &product) ||
        __builtin_mul_overflow(hp.n_layer, std::max<int64_t>(hp.n_expert, 1), &product) ||
        __builtin_mul_overflow(hp.n_ctx_train, hp.n_head_kv * hp.head_dim, &product) ||
        __builtin_mul_overflow(product, hp.n_layer, &product)) {
        throw fail("hyper-parameter products overflow 64 bits");
    }

    // The vocabulary is whatever token_embd holds (some files omit vocab_size).
    hp.n_vocab = tensor_dim(f, "token_embd.weight", 1);
    if (hp.n_vocab <= 0) hp.n_vocab = static_cast<int64_t>(f.get_uint_or(a + "vocab_size", 0));

    if (hp.n_expert > 0) {
        if (hp.n_expert_used <= 0 || hp.n_expert_used > hp.n_expert) {
            throw fail("expert_used_count " + std::to_string(hp.n_expert_used) + " not in [1, expert_count " +
                       std::to_string(hp.n_expert) + "]");
        }
        // Widths the keys leave out, from the first MoE layer's tensors (deepseek2's leading layers
        // are dense); a --mtp sidecar holds no trunk layer, so its nextn block's.
        auto moe_dim = [&](const std::string& tensor) {
            const int64_t d = tensor_dim(f, "blk." + std::to_string(hp.n_layer_dense_lead) + "." + tensor, 1);
            if (d != 0 || hp.n_layer_nextn == 0) return d;
            return tensor_dim(f, "blk." + std::to_string(hp.n_layer) + "." + tensor, 1);
        };
        hp.n_ff_exp = get_or("expert_feed_forward_length", 0, kMaxFfn);
        if (hp.n_ff_exp == 0) hp.n_ff_exp = moe_dim("ffn_gate_exps.weight");
        if (hp.n_ff_exp == 0) hp.n_ff_exp = hp.n_ff;  // Mixtral: feed_forward_length is the expert width
        hp.n_ff_shexp = get_or("expert_shared_feed_forward_length", 0, kMaxFfn);
        hp.n_embd_latent = get_or("moe_latent_size", 0, kMaxEmbd);
        if (hp.n_ff_shexp == 0) hp.n_ff_shexp = moe_dim("ffn_gate_shexp.weight");
    }
    read_ssm_hparams(f, a, hp);
    if (!kv_per_layer.empty() || !ff_per_layer.empty()) {
        // The block pattern from the per-layer arrays (llama.cpp's rule for nemotron_h): attention
        // where head_count_kv > 0, an FFN where feed_forward_length > 0, Mamba-2 where both are 0.
        const size_t n_all = static_cast<size_t>(hp.n_layer + hp.n_layer_nextn);
        if (kv_per_layer.size() != n_all || ff_per_layer.size() != n_all || hp.ssm_d_conv == 0) {
            throw fail("per-layer head_count_kv / feed_forward_length need one entry per block (" +
                       std::to_string(n_all) + ") and the ssm.* keys");
        }
        hp.recurrent_layers.assign(static_cast<size_t>(hp.n_layer), false);
        hp.ffn_only_layers.assign(static_cast<size_t>(hp.n_layer), false);
        for (size_t il = 0; il < static_cast<size_t>(hp.n_layer); ++il) {
            if (kv_per_layer[il] > 0 && ff_per_layer[il] > 0)
                throw fail("block " + std::to_string(il) + " declares both attention and an FFN");
            hp.recurrent_layers[il] = kv_per_layer[il] == 0 && ff_per_layer[il] == 0;
            hp.ffn_only_layers[il] = ff_per_layer[il] > 0;
        }
    }
    hp.expert_weights_norm = f.get_bool_or(a + "expert_weights_norm", spec.expert_weights_norm);
    RouterParams& r = hp.router;
    r.normalize_topk = hp.expert_weights_norm;
    r.weights_scale = static_cast<float>(f.get_float_or(a + "expert_weights_scale", 1.0));
    // llama.cpp's enum: 1 softmax, 2 sigmoid; absent means the arch's default (softmax for
    // DeepSeek-V2 files, which carry none; sigmoid for glm4moe).
    const uint64_t gating =
        f.get_uint_or(a + "expert_gating_func", spec.default_gating == Gating::sigmoid         ? 2
                                                : spec.default_gating == Gating::sqrt_softplus ? 4
                                                                                               : 1);
    if (gating != 1 && gating != 2 && gating != 4) {
        throw UnsupportedError("[model] " + f.path() + ": expert_gating_func " + std::to_string(gating) +
                               " is not supported (1 softmax, 2 sigmoid, 4 sqrt(softplus))");
    }
    r.gating = gating == 2 ? Gating::sigmoid : gating == 4 ? Gating::sqrt_softplus : Gating::softmax;
    r.n_group = get_or("expert_group_count", 1, kMaxExperts);
    r.n_group_used = get_or("expert_group_used_count", static_cast<uint64_t>(r.n_group), kMaxExperts);
    if (hp.n_expert > 0 &&
        (r.n_group <= 0 || hp.n_expert % r.n_group != 0 || r.n_group_used <= 0 ||
         r.n_group_used > r.n_group || r.n_group_used * (hp.n_expert / r.n_group) < hp.n_expert_used)) {
        throw fail("expert groups: " + std::to_string(r.n_group) + " groups, " +
                   std::to_string(r.n_group_used) + " used, do not fit expert_count " +
                   std::to_string(hp.n_expert) + " and expert_used_count " +
                   std::to_string(hp.n_expert_used));
    }

    hp.rope.type = spec.rope_type;
    hp.rope.n_rot = get_or("rope.dimension_count", static_cast<uint64_t>(hp.head_dim), kMaxHeadDim);
    if (hp.rope.n_rot <= 0 || hp.rope.n_rot > hp.head_dim || hp.rope.n_rot % 2 != 0 ||
        (hp.is_mla() && hp.rope.n_rot != hp.head_dim - hp.n_lora_kv)) {
        throw fail("rope.dimension_count " + std::to_string(hp.rope.n_rot) +
                   " must be even and <= head_dim " + std::to_string(hp.head_dim));
    }
    if (hp.has_indexer() && hp.rope.n_rot > hp.indexer_head_dim) {
        throw fail("rope.dimension_count " + std::to_string(hp.rope.n_rot) + " exceeds indexer.key_length " +
                   std::to_string(hp.indexer_head_dim) + " (the indexer rotates its first n_rot dimensions)");
    }
    hp.rope.freq_base = static_cast<float>(f.get_float_or(a + "rope.freq_base", 10000.0));
    const std::string scaling = f.get_string_or(a + "rope.scaling.type", "none");
    const double factor = f.get_float_or(a + "rope.scaling.factor", 0.0);
    // The softmax scale of attention; MLA scales by its per-head q/k width (key_length is the
    // latent's there), times YaRN's mscale^2 below.
    hp.attn_scale = 1.0f / std::sqrt(static_cast<float>(hp.is_mla() ? hp.n_embd_head_k_mla : hp.head_dim));
    if (scaling == "linear" && factor > 0.0) {
        hp.rope.freq_scale = static_cast<float>(1.0 / factor);
    } else if (scaling == "yarn" && factor > 1.0) {
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
        if (hp.is_mla()) {
            const double mscale = attn_factor * (1.0 + log_mul * std::log(factor));
            hp.attn_scale =
                static_cast<float>(mscale * mscale / std::sqrt(static_cast<double>(hp.n_embd_head_k_mla)));
        } else {
            // Other archs (gpt-oss): ggml scales cos/sin by attn_factor * (1 + 0.1 ln(factor)), as
            // transformers' YaRN attention_factor does; the softmax scale stays 1/sqrt(head_dim).
            hp.rope.mscale = static_cast<float>(attn_factor * (1.0 + 0.1 * std::log(factor)));
        }
    } else if (scaling != "none" && !(scaling == "linear" && factor == 0.0)) {
        throw UnsupportedError("[model] " + f.path() + ": rope scaling type '" + scaling +
                               "' is not supported (supported: none, linear, yarn)");
    }
    if (hp.arch == "deepseek4") read_deepseek4_hparams(f, a, hp);
    return hp;
}

}  // namespace sharpi
