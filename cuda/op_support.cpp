// The CUDA backend's support table (backend/cuda_interface.h unsupported_op): which OpCalls the
// kernels of cuda/ops run, judged on the host in every build (with or without nvcc), so the host
// test of the one forward pass (tests/test_backend_ops.py) shows for every architecture which op,
// if any, keeps it off the GPU. Keep it in step with cuda/ops and the CUDA backend: a kernel added
// there is a row here and its launch in cuda_backend.cu, which checks every call through this table.
#include <cstdlib>
#include <string>
#include <vector>

#include "backend/cuda_interface.h"
#include "block_math_host.h"

namespace sharpi::cuda {

namespace {

constexpr int64_t kMaxHeadDim = 256;  // ops/attention.cuh kMaxAttentionHeadDim
constexpr int64_t kMaxExperts = 512;  // ops/router.cu kMaxExperts

// Ops cuda/ops has a kernel for (the Backend method names).
const char* const kImplemented[] = {
    "copy",
    "copy_rows",
    "get_rows",
    "rms_norm",
    "matmul",
    "add_bias",
    "add",
    "swiglu",
    "swiglu_clamped",
    "relu_sqr",
    "rope",
    "kv_store",
    "attention",
    "scale_rows",
    "scale_rows_sigmoid",
    "route_topk",
    "topk_weights",
    "expert_ffn_one_token",
    "expert_ffn_slots",
    "expert_ffn_batch",
    "moe_combine",
};
// Ops with no CUDA kernel yet, and what they belong to.
struct Missing {
    const char* op;
    const char* what;
};
const Missing kMissing[] = {
    {"mla_attention", "deepseek2's multi-head latent attention"},
    {"lightning_indexer", "deepseek32's DSA lightning indexer"},
    {"layer_norm", "deepseek32's DSA indexer key norm"},
    {"gdn_gates", "the Gated DeltaNet (qwen3next, qwen35moe)"},
    {"conv1d_silu", "the Gated DeltaNet's causal conv1d"},
    {"l2_norm_heads", "the Gated DeltaNet's q/k normalisation"},
    {"gated_delta_rule", "the Gated DeltaNet's delta rule"},
    {"ssm_scan", "Mamba-2's selective scan"},
    {"rms_norm_unweighted", "deepseek4's hyper-connection and query norms"},
    {"hc_block_weights", "deepseek4's hyper-connections"},
    {"hc_head_weights", "deepseek4's hyper-connection head"},
    {"hc_collapse", "deepseek4's hyper-connections"},
    {"hc_expand", "deepseek4's hyper-connections"},
    {"compressed_attention", "deepseek4's sliding-window and compressed sparse attention"},
    {"mul_sigmoid", "gated attention's output gate (qwen3next, qwen35moe)"},
    {"mul_silu", "the Gated DeltaNet's gated RMSNorm"},
};

std::vector<std::string> tags(const std::string& variant) {
    std::vector<std::string> out;
    size_t start = 0;
    while (start < variant.size()) {
        const size_t end = variant.find(',', start);
        out.push_back(variant.substr(start, end == std::string::npos ? std::string::npos : end - start));
        if (end == std::string::npos) break;
        start = end + 1;
    }
    return out;
}

// The value of a "key=N" tag, or -1 when it is another tag.
int64_t sized(const std::string& tag, const char* key) {
    const std::string prefix = std::string(key) + "=";
    return tag.compare(0, prefix.size(), prefix) == 0 ? std::atoll(tag.c_str() + prefix.size()) : -1;
}

}  // namespace

std::vector<std::string> implemented_ops() {
    return std::vector<std::string>(std::begin(kImplemented), std::end(kImplemented));
}

std::string unsupported_op(const OpCall& call) {
    const std::string what = call.op + " (" + ggml_type_traits(call.type).name +
                             (call.variant.empty() ? "" : ", " + call.variant) + ")";
    const auto no = [&](const std::string& why) { return what + ": " + why; };
    for (const Missing& m : kMissing) {
        if (call.op == m.op) return no(std::string("no CUDA kernel yet for ") + m.what);
    }
    bool known = false;
    for (const char* op : kImplemented) known = known || call.op == op;
    if (!known) return no("not an op of the backend interface");

    const bool reads_weights =
        call.op == "get_rows" || call.op == "matmul" || call.op.rfind("expert_ffn", 0) == 0;
    if (reads_weights && !host_has_block_math(call.type)) return no("no device block math for this type");
    if ((call.op == "kv_store" || call.op == "attention") && call.type != GgmlType::F32)
        return no("the device KV cache is f32");
    for (const std::string& tag : tags(call.variant)) {
        if (tag == "exact") continue;  // every device kernel has an exact (dequantized f32) path
        if (call.op == "attention") {
            if (tag == "sinks" || tag == "window" || tag == "chunk") continue;  // ops/attention.cuh
            if (sized(tag, "head_dim") > kMaxHeadDim)
                return no("device attention takes head_dim up to " + std::to_string(kMaxHeadDim));
            if (sized(tag, "head_dim") >= 0) continue;
        } else if (call.op == "rope") {
            if (tag == "yarn" || tag == "freq_factors") continue;  // ops/rope.cuh
        } else if (call.op == "route_topk") {
            if (sized(tag, "n_expert") > kMaxExperts)
                return no("the device router takes at most " + std::to_string(kMaxExperts) + " experts");
            if (sized(tag, "n_expert") >= 0) continue;
            // ops/router.cu: softmax, sigmoid or sqrt(softplus) gating, a selection bias, ranking by
            // the logits, a weight scale; not DeepSeek-V3's group-limited choice.
            if (tag == "sigmoid" || tag == "sqrt_softplus" || tag == "scale" || tag == "selection_bias" ||
                tag == "rank_logits")
                continue;
            return no("the device router has no expert groups (group-limited routing)");
        } else if (call.op.rfind("expert_ffn", 0) == 0) {
            // ops/expert_ffn.cuh: biases and the activation variants of ops/activation.cuh.
            if (tag == "bias" || tag == "clamped_swiglu" || tag == "clamped_swiglu_v4" || tag == "relu_sqr")
                continue;
        }
        return no("variant '" + tag + "' is not on the device");
    }
    return "";
}

}  // namespace sharpi::cuda
