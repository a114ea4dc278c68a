// The device forward pass's plan (backend/cuda_interface.h plan_device_model, device_plan.h): which tensors
// go to VRAM, what the activation arena takes, and every limit of the device path, checked on the
// host before anything is allocated. Plain C++, built in every build (CUDA or not), so the host tests
// check the refusals and the size accounting without a device.
#include "device_plan.h"

#include <algorithm>
#include <string>

#include "backend/cuda_interface.h"
#include "block_math_host.h"
#include "model/model.h"
#include "sharpi/errors.h"

namespace sharpi::cuda {
namespace {

constexpr int64_t kMaxHeadDim = 256;  // ops/attention.cuh kMaxAttentionHeadDim
constexpr int64_t kMaxExperts = 512;  // ops/router.cu kMaxExperts

// Bump layout: every buffer 256-byte aligned.
struct Carve {
    size_t used = 0;
    size_t take(size_t bytes) {
        const size_t at = used;
        used += (bytes + 255) / 256 * 256;
        return at;
    }
};

void add_view(std::vector<HostWeight>& out, const std::string& name, const WeightView& w) {
    if (w.data == nullptr) return;
    for (const HostWeight& seen : out) {
        if (seen.data == w.data) return;  // tied output head: token_embd already goes up
    }
    out.push_back(HostWeight{name, w.type, w.data, static_cast<uint64_t>(w.n_rows) * w.row_bytes, false});
}

void add_vector(std::vector<HostWeight>& out, const std::string& name, const std::vector<float>& v) {
    if (v.empty()) return;
    out.push_back(HostWeight{name, GgmlType::F32, v.data(), sizeof(float) * v.size(), false});
}

void add_linear(std::vector<HostWeight>& out, int il, const char* name, const Linear& l) {
    add_view(out, ModelLoader::block_name(il, name) + ".weight", l.w);
    add_vector(out, ModelLoader::block_name(il, name) + ".bias", l.bias);
}

[[noreturn]] void unsupported(const std::string& arch, const std::string& why) {
    throw UnsupportedError("[cuda] device=\"cuda\" for " + arch + ": " + why + " (use device=\"cpu\")");
}

}  // namespace

std::vector<HostWeight> device_weights(const Model& model) {
    const HParams& h = model.hp;
    std::vector<HostWeight> out;
    add_view(out, "token_embd.weight", model.token_embd);
    for (int il = 0; il < h.n_layer; ++il) {
        const LayerWeights& L = model.layers[static_cast<size_t>(il)];
        add_vector(out, ModelLoader::block_name(il, "attn_norm.weight"), L.attn_norm);
        add_linear(out, il, "attn_q", L.wq);
        add_linear(out, il, "attn_k", L.wk);
        add_linear(out, il, "attn_v", L.wv);
        add_linear(out, il, "attn_output", L.wo);
        add_vector(out, ModelLoader::block_name(il, "attn_q_norm.weight"), L.attn_q_norm);
        add_vector(out, ModelLoader::block_name(il, "attn_k_norm.weight"), L.attn_k_norm);
        add_vector(out, ModelLoader::block_name(il, "ffn_norm.weight"), L.ffn_norm);
        add_view(out, ModelLoader::block_name(il, "ffn_gate_inp.weight"), L.ffn_gate_inp);
        const bool moe = model.experts.layers[static_cast<size_t>(il)].present();
        const char* suffix = moe ? "_shexp" : "";
        add_linear(out, il, (std::string("ffn_gate") + suffix).c_str(), L.ffn_gate);
        add_linear(out, il, (std::string("ffn_up") + suffix).c_str(), L.ffn_up);
        add_linear(out, il, (std::string("ffn_down") + suffix).c_str(), L.ffn_down);
        add_view(out, ModelLoader::block_name(il, "ffn_gate_inp_shexp.weight"), L.ffn_gate_inp_shexp);
        // The tensors of the other architectures (empty for the plain MoE ones, so their plan is
        // unchanged): MLA (deepseek2), the Gated DeltaNet (qwen3next, qwen35moe), gpt-oss's sinks and
        // biases, the DeepSeek-V3 selection bias. The CUDA backend finds every weight a builder names,
        // so an op the device lacks is refused by name rather than by a missing upload.
        add_linear(out, il, "attn_q_a", L.wq_a);
        add_linear(out, il, "attn_q_b", L.wq_b);
        add_linear(out, il, "attn_kv_a_mqa", L.wkv_a_mqa);
        add_vector(out, ModelLoader::block_name(il, "attn_q_a_norm.weight"), L.attn_q_a_norm);
        add_vector(out, ModelLoader::block_name(il, "attn_kv_a_norm.weight"), L.attn_kv_a_norm);
        add_view(out, ModelLoader::block_name(il, "attn_k_b.weight"), L.wk_b);
        add_view(out, ModelLoader::block_name(il, "attn_v_b.weight"), L.wv_b);
        add_linear(out, il, "indexer.attn_q_b", L.indexer_attn_q_b);
        add_linear(out, il, "indexer.attn_k", L.indexer_attn_k);
        add_linear(out, il, "indexer.proj", L.indexer_proj);
        add_vector(out, ModelLoader::block_name(il, "indexer.k_norm.weight"), L.indexer_k_norm);
        add_vector(out, ModelLoader::block_name(il, "indexer.k_norm.bias"), L.indexer_k_norm_b);
        add_vector(out, ModelLoader::block_name(il, "exp_probs_b.bias"), L.exp_probs_b);
        add_linear(out, il, "attn_qkv", L.ssm_qkv);
        add_linear(out, il, "attn_gate", L.ssm_gate);
        add_linear(out, il, "ssm_in", L.ssm_in);
        add_linear(out, il, "ssm_ba", L.ssm_ba);
        add_linear(out, il, "ssm_beta", L.ssm_beta);
        add_linear(out, il, "ssm_alpha", L.ssm_alpha);
        add_linear(out, il, "ssm_out", L.ssm_out);
        add_vector(out, ModelLoader::block_name(il, "ssm_conv1d.weight"), L.ssm_conv1d);
        add_vector(out, ModelLoader::block_name(il, "ssm_a"), L.ssm_a);
        add_vector(out, ModelLoader::block_name(il, "ssm_dt.bias"), L.ssm_dt_bias);
        add_vector(out, ModelLoader::block_name(il, "ssm_conv1d.bias"), L.ssm_conv1d_b);
        add_vector(out, ModelLoader::block_name(il, "ssm_d"), L.ssm_d);
        add_vector(out, ModelLoader::block_name(il, "ssm_norm.weight"), L.ssm_norm);
        add_vector(out, ModelLoader::block_name(il, "attn_sinks.weight"), L.attn_sinks);
        add_vector(out, ModelLoader::block_name(il, "ffn_gate_inp.bias"), L.ffn_gate_inp_b);
        add_vector(out, ModelLoader::block_name(il, "ffn_gate_exps.bias"), L.ffn_gate_exps_b);
        add_vector(out, ModelLoader::block_name(il, "ffn_up_exps.bias"), L.ffn_up_exps_b);
        add_vector(out, ModelLoader::block_name(il, "ffn_down_exps.bias"), L.ffn_down_exps_b);
        // deepseek4's matrices (the device path refuses the arch; listed so the table names its ops).
        add_linear(out, il, "attn_kv", L.wkv);
        add_vector(out, ModelLoader::block_name(il, "attn_kv_a_norm.weight"), L.attn_kv_norm);
        add_linear(out, il, "attn_output_a", L.wo_a);
        add_linear(out, il, "attn_output_b", L.wo_b);
        add_linear(out, il, "hc_attn_fn", L.hc_attn_fn);
        add_linear(out, il, "hc_ffn_fn", L.hc_ffn_fn);
        add_linear(out, il, "attn_compressor_kv", L.comp_wkv);
        add_linear(out, il, "attn_compressor_gate", L.comp_wgate);
        add_linear(out, il, "indexer_compressor_kv", L.idx_comp_wkv);
        add_linear(out, il, "indexer_compressor_gate", L.idx_comp_wgate);
        add_linear(out, il, "indexer.attn_q_b", L.idx_q_b);
        add_linear(out, il, "indexer.proj", L.idx_proj);
        add_vector(out, ModelLoader::block_name(il, "hc_attn_base.weight"), L.hc_attn_base);
        add_vector(out, ModelLoader::block_name(il, "hc_attn_scale.weight"), L.hc_attn_scale);
        add_vector(out, ModelLoader::block_name(il, "hc_ffn_base.weight"), L.hc_ffn_base);
        add_vector(out, ModelLoader::block_name(il, "hc_ffn_scale.weight"), L.hc_ffn_scale);
        add_vector(out, ModelLoader::block_name(il, "attn_compressor_ape.weight"), L.comp_ape);
        add_vector(out, ModelLoader::block_name(il, "attn_compressor_norm.weight"), L.comp_norm);
        add_vector(out, ModelLoader::block_name(il, "indexer_compressor_ape.weight"), L.idx_comp_ape);
        add_vector(out, ModelLoader::block_name(il, "indexer_compressor_norm.weight"), L.idx_comp_norm);
        if (!moe) continue;
        for (int part = 0; part < kExpertParts; ++part) {
            const ExpertPart& p = model.experts.part(il, part);
            out.push_back(HostWeight{p.tensor, p.view.type, p.view.data,
                                     p.bytes * static_cast<uint64_t>(model.experts.n_expert), true});
        }
    }
    add_vector(out, "output_norm.weight", model.output_norm);
    add_view(out, "output.weight", model.output);
    add_view(out, "output_hc_fn.weight", model.hc_head_fn.w);
    add_vector(out, "output_hc_base.weight", model.hc_head_base);
    add_vector(out, "output_hc_scale.weight", model.hc_head_scale);
    return out;
}

DeviceArena device_arena(const HParams& h, int64_t max_batch, int64_t n_ff_dense) {
    const size_t B = static_cast<size_t>(max_batch), f = sizeof(float);
    const size_t k = static_cast<size_t>(h.n_expert_used);
    const size_t E = static_cast<size_t>(h.n_embd), Q = static_cast<size_t>(h.n_embd_q());
    DeviceArena a;
    Carve c;
    a.x = c.take(f * B * E);
    a.cur = c.take(f * B * E);
    a.q = c.take(f * B * Q);
    a.attn = c.take(f * B * Q);
    a.tmp = c.take(f * B * E);
    a.ffn_inp = c.take(f * B * E);
    a.ffn_out = c.take(f * B * E);
    a.router = c.take(f * B * static_cast<size_t>(h.n_expert));
    a.ids = c.take(sizeof(int32_t) * B * k);
    a.weights = c.take(f * B * k);
    a.ffn_g = c.take(f * B * static_cast<size_t>(n_ff_dense));
    a.ffn_u = c.take(f * B * static_cast<size_t>(n_ff_dense));
    a.shexp_gate = c.take(f * B);
    const int64_t widest_in = std::max({h.n_embd, h.n_embd_q(), n_ff_dense});
    a.xq = c.take(q8_act_row_bound(widest_in) * B);
    // expert_ffn.cu's carve for B tokens of k slots: h, partial, xg, g, u (f32), xq, hq, rows, order.
    Carve e;
    const size_t rows = B * k, ff = static_cast<size_t>(h.n_ff_exp);
    e.take(f * rows * ff);
    e.take(f * rows * E);
    e.take(f * rows * E);
    e.take(f * rows * ff);
    e.take(f * rows * ff);
    e.take(q8_act_row_bound(h.n_embd) * rows);
    e.take(q8_act_row_bound(h.n_ff_exp) * rows);
    e.take(sizeof(int32_t) * rows);
    e.take(sizeof(int32_t) * rows);
    a.expert_scratch_bytes = e.used;
    a.experts = c.take(e.used);
    a.logits = c.take(f * B * static_cast<size_t>(h.n_vocab));
    a.routing = c.take(sizeof(int32_t) * static_cast<size_t>(h.n_layer) * B * k);
    a.total = c.used;
    return a;
}

DevicePlan plan_device_model(const Model& model, int64_t n_ctx, int64_t max_batch, GgmlType type_k,
                             GgmlType type_v) {
    const HParams& h = model.hp;
    const std::string& arch = h.arch;
    const bool plain_moe =
        h.is_moe() && (arch == "qwen3moe" || arch == "qwen2moe" || arch == "olmoe" || arch == "llama");
    if (!plain_moe) {
        unsupported(arch,
                    "the device path computes the plain MoE architectures only (qwen3moe, qwen2moe, "
                    "olmoe, mixtral), not " +
                        arch + (h.is_moe() ? "" : " without experts"));
    }
    if (model.streaming) unsupported(arch, "every weight is resident on the device (no ram_budget)");
    const RouterParams& r = h.router;
    if (r.gating != Gating::softmax || r.n_group != 1 || r.weights_scale != 1.0f) {
        unsupported(arch,
                    "the device router is softmax top-k (no sigmoid gating, expert groups or weight scale)");
    }
    if (h.rope.ext_factor != 0.0f || h.rope.mscale != 1.0f)
        unsupported(arch, "YaRN RoPE is not on the device");
    if (h.rope.n_rot > h.head_dim || h.rope.n_rot % 2 != 0) {
        unsupported(arch, "rope.dimension_count " + std::to_string(h.rope.n_rot) + " with head_dim " +
                              std::to_string(h.head_dim));
    }
    if (h.is_mla() || !h.recurrent_layers.empty())
        unsupported(arch, "MLA and recurrent layers are not on the device");
    if (h.head_dim > kMaxHeadDim || h.n_head_kv <= 0 || h.n_head % h.n_head_kv != 0) {
        unsupported(arch, "head_dim " + std::to_string(h.head_dim) + " (device attention: at most " +
                              std::to_string(kMaxHeadDim) + ", n_head a multiple of n_head_kv)");
    }
    if (h.n_expert > kMaxExperts || h.n_expert_used < 1 || h.n_expert_used > h.n_expert) {
        unsupported(arch, std::to_string(h.n_expert) + " experts, top-" + std::to_string(h.n_expert_used) +
                              " (the device router takes at most " + std::to_string(kMaxExperts) + ")");
    }
    if (type_k != GgmlType::F32 || type_v != GgmlType::F32) {
        unsupported(arch, std::string("the device KV cache is f32, not ") + ggml_type_traits(type_k).name +
                              "/" + ggml_type_traits(type_v).name);
    }
    int64_t n_ff_dense = 0;
    for (int il = 0; il < h.n_layer; ++il) {
        const LayerWeights& L = model.layers[static_cast<size_t>(il)];
        const std::string where = "layer " + std::to_string(il) + ": ";
        if (L.attn_output_gate || L.attn_window != 0 || !L.attn_sinks.empty()) {
            unsupported(arch, where + "gated, sliding-window or sink attention is not on the device");
        }
        if (!L.attn_rope || L.attn_chunk != 0 || L.attn_temp_floor_scale != 0 || !L.rope_freqs.empty() ||
            L.expert_input_weighted) {
            unsupported(arch, where +
                                  "llama4's NoPE, chunked and temperature-tuned attention, RoPE frequency "
                                  "factors and router-weighted expert inputs are not on the device");
        }
        if (!L.exp_probs_b.empty() || !L.ffn_gate_inp_b.empty() || !L.ffn_gate_exps_b.empty() ||
            !L.ffn_up_exps_b.empty() || !L.ffn_down_exps_b.empty() || L.expert_swiglu_limit != 0.0f ||
            L.expert_relu_sqr || L.ffn_latent_down.present()) {
            unsupported(
                arch,
                where +
                    "router or expert biases, ungated (relu^2) experts and latent MoE are not on the device");
        }
        if (L.ffn_gate.present()) n_ff_dense = std::max(n_ff_dense, L.ffn_gate.w.n_rows);
        if (!model.experts.layers[static_cast<size_t>(il)].present() && !L.ffn_gate.present()) {
            unsupported(arch, where + "neither routed experts nor a dense FFN");
        }
    }
    DevicePlan plan;
    plan.arch = arch;
    plan.n_ctx = n_ctx;
    plan.max_batch = max_batch;
    plan.n_ff_dense = n_ff_dense;
    for (const HostWeight& w : device_weights(model)) {
        if (!host_has_block_math(w.type)) {
            unsupported(arch, "tensor " + w.name + " is " + ggml_type_traits(w.type).name +
                                  ", a type without device kernels");
        }
        plan.uploads.push_back(DeviceUpload{w.name, w.type, w.bytes, w.expert});
        (w.expert ? plan.expert_bytes : plan.dense_bytes) += w.bytes;
    }
    plan.kv_bytes = 2ull * sizeof(float) * static_cast<uint64_t>(h.n_layer) * static_cast<uint64_t>(n_ctx) *
                    static_cast<uint64_t>(h.n_embd_kv());
    // The arena, plus the 256-byte alignment of each upload inside the one weight allocation.
    plan.buffer_bytes = device_arena(h, max_batch, n_ff_dense).total + 256 * plan.uploads.size();
    return plan;
}

}  // namespace sharpi::cuda
