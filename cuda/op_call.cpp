// The OpCall builders of backend/op_call.h. Declared in the core, compiled into the CUDA target's
// host sources (beside op_support.cpp, in every build): the CUDA backend calls them, and a static
// link puts the core's archive before the backend's, so the backend's archive must resolve them
// itself (a C++ host that links the installed libsharpi.a and libsharpi_cuda_backend.a failed on
// them when they lived in the core). The core's RecordingBackend finds them in the backend's archive.
#include "backend/op_call.h"

#include <algorithm>
#include <utility>

namespace sharpi {

namespace {

std::string join(const std::vector<std::string>& parts) {
    std::string out;
    for (const std::string& p : parts) out += (out.empty() ? "" : ",") + p;
    return out;
}

}  // namespace

OpCall matmul_call(const WeightView& w, bool exact) {
    return OpCall{"matmul", w.type, exact ? "exact" : ""};
}

OpCall rope_call(const RopeParams& p) {
    std::vector<std::string> v;
    if (p.ext_factor != 0.0f || p.mscale != 1.0f) v.push_back("yarn");
    if (p.freq_factors) v.push_back("freq_factors");
    return OpCall{"rope", GgmlType::F32, join(v)};
}

std::vector<OpCall> kv_store_calls(GgmlType type_k, GgmlType type_v, bool with_v) {
    std::vector<OpCall> out{OpCall{"kv_store", type_k, ""}};
    if (with_v && type_v != type_k) out.push_back(OpCall{"kv_store", type_v, ""});
    return out;
}

OpCall attention_call(GgmlType type_k, const AttentionShape& shape) {
    std::vector<std::string> v;
    if (shape.sinks) v.push_back("sinks");
    if (shape.window > 0) v.push_back("window");
    if (shape.chunk > 0) v.push_back("chunk");
    v.push_back("head_dim=" + std::to_string(shape.head_dim));
    return OpCall{"attention", type_k, join(v)};
}

OpCall route_topk_call(const RouterParams& params, int64_t n_expert) {
    std::vector<std::string> v;
    if (params.gating == Gating::sigmoid) v.push_back("sigmoid");
    if (params.gating == Gating::sqrt_softplus) v.push_back("sqrt_softplus");
    if (params.n_group > 1) v.push_back("groups");
    if (params.weights_scale != 1.0f) v.push_back("scale");
    if (params.selection_bias) v.push_back("selection_bias");
    if (params.rank_logits) v.push_back("rank_logits");
    v.push_back("n_expert=" + std::to_string(n_expert));
    return OpCall{"route_topk", GgmlType::F32, join(v)};
}

std::vector<OpCall> expert_calls(const char* op, const ExpertFfnWeights* experts, int64_t n, bool exact) {
    std::vector<OpCall> out;
    for (int64_t i = 0; i < n; ++i) {
        const ExpertFfnWeights& e = experts[i];
        std::vector<std::string> v;
        if (e.gate_b || e.up_b || e.down_b) v.push_back("bias");
        if (e.swiglu_limit > 0.0f) v.push_back("clamped_swiglu");
        if (e.swiglu_clamp > 0.0f) v.push_back("clamped_swiglu_v4");
        if (e.relu_sqr) v.push_back("relu_sqr");
        if (exact) v.push_back("exact");
        const std::string variant = join(v);
        for (GgmlType t : {e.gate.type, e.up.type, e.down.type}) {
            const bool seen = std::any_of(
                out.begin(), out.end(), [&](const OpCall& c) { return c.type == t && c.variant == variant; });
            if (!seen) out.push_back(OpCall{op, t, variant});
        }
    }
    return out;
}

}  // namespace sharpi
