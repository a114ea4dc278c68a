// OpCall: one op as the layer builders ask a backend to run it, as RecordingBackend records it and
// as the CUDA backend's support table (backend/cuda_interface.h unsupported_op) judges it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/op_types.h"
#include "quant/ggml_type.h"

namespace sharpi {

// One op as a backend is asked to run it. op: the Backend method's name. type: the weight type the
// op reads (a matmul's matrix, an expert's projection, the embedding table; the cache's type for the
// KV ops; F32 for ops on activations alone). variant: "" for the plain op, else what it asks beyond
// it (attention "sinks" / "window", rope "yarn", route_topk "sigmoid" / "groups" / "scale" /
// "selection_bias", expert ops "bias" / "clamped_swiglu", matmul and experts "exact"; comma-separated,
// with the sizes a kernel may bound: attention "head_dim=N", route_topk "n_expert=N").
struct OpCall {
    std::string op;
    GgmlType type = GgmlType::F32;
    std::string variant;
};

// A weight an op reads, named by its host address (RecordingBackend::weight_reads).
struct WeightRead {
    std::string op;
    const void* data = nullptr;
};

// The OpCall of each op whose type or variant depends on its arguments, built in one place so that
// RecordingBackend records exactly what a device backend judges (cuda/cuda_backend.cu checks every
// call through backend/cuda_interface.h unsupported_op before it launches anything).
OpCall matmul_call(const WeightView& w, bool exact);
OpCall rope_call(const RopeParams& p);
// kv_store reads the K type, and the V type too when V rows are stored and it differs.
std::vector<OpCall> kv_store_calls(GgmlType type_k, GgmlType type_v, bool with_v);
OpCall attention_call(GgmlType type_k, const AttentionShape& shape);
OpCall route_topk_call(const RouterParams& params, int64_t n_expert);
// One call per distinct (projection type, variant) of the n experts.
std::vector<OpCall> expert_calls(const char* op, const ExpertFfnWeights* experts, int64_t n, bool exact);

}  // namespace sharpi
